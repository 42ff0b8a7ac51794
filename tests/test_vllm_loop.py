"""The engine loop's scheduling (meshrl.engines.vllm_loop) over a scripted stand-in for vLLM's
`LLMEngine` (every step advances each running request by one token; a request of length n
finishes at its n-th step): requests join the running batch at the next step and finish on their
own, a pause waits for the running requests and holds new ones back until it ends, calls run on the
engine's own thread, and a failing step fails every request in flight and every later one.
The loop over the real engine is tested in tests/test_api.py (continuous batching, seeds, version
switches)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait
from types import SimpleNamespace

import pytest

from meshrl.engines.vllm_loop import EngineFailed, EngineLoop, gather


class ScriptedEngine:
    """`llm` and `llm.llm_engine` at once: params are the number of steps a request runs."""

    def __init__(self, step_s: float = 0.01):
        self.llm_engine = self
        self.step_s = step_s
        self.running: dict[str, list] = {}  # request id -> [steps left, prompt]
        self.batches: list[set[str]] = []  # the request ids of every step
        self.thread: threading.Thread | None = None
        self.fail_at_step: int | None = None

    def add_request(self, request_id, prompt, params, lora_request=None):
        if params.steps < 1:
            raise ValueError(f"steps = {params.steps}")
        self.running[request_id] = [params.steps, prompt["prompt_token_ids"]]

    def step(self):
        self.thread = threading.current_thread()
        if self.fail_at_step is not None and len(self.batches) == self.fail_at_step:
            raise RuntimeError("the device fell over")
        time.sleep(self.step_s)
        self.batches.append(set(self.running))
        out = []
        for request_id, state in list(self.running.items()):
            state[0] -= 1
            if not state[0]:
                del self.running[request_id]
                out.append(SimpleNamespace(request_id=request_id, finished=True, prompt=state[1],
                                           steps=len(self.batches)))
        return out


def params(steps: int) -> SimpleNamespace:
    return SimpleNamespace(steps=steps)


@pytest.fixture
def loop():
    engine = ScriptedEngine()
    loop = EngineLoop(lambda: engine)
    yield loop
    loop.close()


def test_a_request_joins_the_running_batch_at_the_next_step_and_finishes_on_its_own(loop):
    [long] = loop.submit([([1], params(40))])
    while len(loop.llm.batches) < 5:
        time.sleep(0.005)
    [short] = loop.submit([([2], params(3))])
    done = short.result(timeout=10)
    assert not long.done()  # the short one did not wait for the long one
    joined = next(i for i, batch in enumerate(loop.llm.batches) if len(batch) == 2)
    assert joined >= 5 and done.steps == joined + 3 and done.prompt == [2]
    assert long.result(timeout=10).steps == 40


def test_a_pause_waits_for_the_running_requests_and_holds_new_ones_until_it_ends(loop):
    [running] = loop.submit([([1], params(20))])
    while not loop.llm.batches:
        time.sleep(0.005)
    with loop.paused():
        assert running.done() and not loop.llm.running  # nothing runs inside the pause
        [held] = loop.submit([([2], params(2))])
        time.sleep(0.1)
        assert not held.done() and not loop.llm.running
        with loop.paused():  # re-entrant
            pass
        time.sleep(0.05)
        assert not held.done()
        steps_inside = len(loop.llm.batches)
    assert held.result(timeout=10).steps == steps_inside + 2


def test_calls_run_on_the_engines_thread_between_steps(loop):
    [running] = loop.submit([([1], params(10))])
    thread = loop.call(lambda llm: threading.current_thread())
    assert thread is not threading.current_thread() and thread.name == "vllm-engine"
    running.result(timeout=10)
    assert loop.llm.thread is thread
    with pytest.raises(ZeroDivisionError):
        loop.call(lambda llm: 1 / 0)  # the caller's own error; the loop goes on
    assert loop.submit([([3], params(1))])[0].result(timeout=10).prompt == [3]


def test_a_request_the_engine_refuses_fails_alone(loop):
    bad, good = loop.submit([([1], params(0)), ([2], params(2))])
    with pytest.raises(ValueError, match="steps = 0"):
        bad.result(timeout=10)
    assert good.result(timeout=10).prompt == [2]


def test_a_failing_step_fails_every_request_in_flight_and_every_later_one():
    engine = ScriptedEngine()
    engine.fail_at_step = 3
    loop = EngineLoop(lambda: engine)
    futures = loop.submit([([1], params(10)), ([2], params(20))])
    wait(futures, timeout=10)
    for future in futures:
        with pytest.raises(EngineFailed, match="the device fell over"):
            future.result()
    with pytest.raises(EngineFailed):
        loop.submit([([3], params(1))])
    with loop.paused():  # nothing to wait for
        pass
    loop.close()


def test_gather_combines_results_or_fails_with_the_first_failure(loop):
    a, b = loop.submit([([1], params(2)), ([2], params(1))])
    assert gather([a, b], lambda outs: [o.prompt for o in outs]).result(timeout=10) == [[1], [2]]
    bad, good = loop.submit([([1], params(0)), ([2], params(1))])
    with pytest.raises(ValueError):
        gather([bad, good], list).result(timeout=10)
