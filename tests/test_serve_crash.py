"""A learner SIGKILLed under `meshrl serve`, for real: two sessions of the official SDK, each with
its own LoRA training client, train; the learner process is killed while one holds gradients it has
not applied yet; the server replaces it, and both clients go on as if nothing had happened: every
forward and the rest of their training equal twins that trained without a crash (adapter, AdamW
state, step count, the pending gradients), and a sampler saved before the crash samples the same
weights after it."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import psutil
import pytest
from tinker import types as T

from tests.test_serve_live import ALIAS, logprobs, server, sl_data  # noqa: F401 - `server` is a fixture

pytestmark = [pytest.mark.monarch, pytest.mark.slow]

ADAM = T.AdamParams(learning_rate=2e-2)


def _before(tc, seed):
    """Two steps, then gradients accumulated but not applied."""
    for k in range(2):
        tc.forward_backward(sl_data(seed + k), "cross_entropy")
        tc.optim_step(ADAM)
    return tc.forward_backward(sl_data(seed + 2), "cross_entropy")


def _after(tc, seed):
    """The pending gradients applied, one more step; the loss of its forward_backward."""
    tc.optim_step(ADAM)
    fb = tc.forward_backward(sl_data(seed + 3), "cross_entropy")
    tc.optim_step(ADAM)
    return fb


def _forward(tc, data):
    return logprobs(tc.forward(data, "cross_entropy").result(timeout=300))


def _equal(x, y):
    return all(np.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(x, y, strict=True))


def test_both_tenants_survive_a_sigkilled_learner(server):  # noqa: F811
    from meshrl.api import connect

    os.environ["TINKER_TELEMETRY"] = "0"
    probe = sl_data(99)
    prompt = T.ModelInput.from_ints([5, 17, 42, 9, 3])
    specs = {"a": dict(rank=4, seed=1), "b": dict(rank=8, seed=2)}
    seeds = {"a": 10, "b": 20}

    # twins trained without a crash, in a session of their own (finished before the kill)
    reference = {}
    with connect(server.url, api_key="tml-test") as twins:
        for name, spec in specs.items():
            twin = twins.create_lora_training_client(base_model=ALIAS, **spec).result(timeout=300)
            _before(twin, seeds[name]).result(timeout=300)
            mid = _forward(twin, probe)
            loss = _after(twin, seeds[name]).result(timeout=300).metrics["loss:sum"]
            reference[name] = (mid, loss, _forward(twin, probe))

    with connect(server.url, api_key="tml-test") as one, connect(server.url, api_key="tml-test") as two:
        clients = {"a": one.create_lora_training_client(base_model=ALIAS, **specs["a"]).result(timeout=300),
                   "b": two.create_lora_training_client(base_model=ALIAS, **specs["b"]).result(timeout=300)}
        for name, tc in clients.items():
            _before(tc, seeds[name]).result(timeout=300)
            assert _equal(_forward(tc, probe), reference[name][0]), name
        sampler = clients["a"].save_weights_and_get_sampling_client().result(timeout=300)
        sampled_before = sampler.compute_logprobs(prompt).result(timeout=300)

        [learner] = server.pids["learner"]
        os.kill(learner, signal.SIGKILL)
        try:
            psutil.Process(learner).wait(timeout=30)
        except psutil.NoSuchProcess:
            pass
        started = time.perf_counter()
        # sent at once: the first finds the learner dead, and the server replaces it before issuing it
        pending = {name: _after(tc, seeds[name]) for name, tc in clients.items()}
        for name, fb in pending.items():
            assert fb.result(timeout=300).metrics["loss:sum"] == pytest.approx(reference[name][1], abs=1e-5), name
        recovered_s = time.perf_counter() - started
        for name, tc in clients.items():
            assert _equal(_forward(tc, probe), reference[name][2]), name

        sampled_after = sampler.compute_logprobs(prompt).result(timeout=300)
        assert sampled_after[1:] == pytest.approx(sampled_before[1:], abs=1e-4)  # its version published again
        base = two.create_sampling_client(base_model=ALIAS).result(timeout=300)
        base = base.compute_logprobs(prompt).result(timeout=300)
        assert base[1:] != pytest.approx(sampled_after[1:], abs=1e-3)

    log = server.log.read_text()
    replaced = re.findall(r"learner replaced \(pids \[(\d+)\]\): weight versions \[([0-9, ]*)\] published again, "
                          r"(\d+) training clients restored", log)
    assert len(replaced) == 1, log[-3000:]
    new_pid, versions, tenants = replaced[0]
    assert int(new_pid) != learner and psutil.pid_exists(int(new_pid))
    assert tenants == "2" and versions.startswith("0")
    assert server.proc.poll() is None
    print(f"\nthe first calls after the kill answered in {recovered_s:.1f}s; server log:\n"
          + "\n".join(line for line in log.splitlines() if "learner" in line and "recover" in line or "replaced" in line))
