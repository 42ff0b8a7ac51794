"""The API sampler's admission of requests by weight version (meshrl.api.sampler), over a stand-in
backend whose `sample` calls block until the test releases them: requests of the held version
start at once, each on its own; a request of another version waits, and so does every later one,
until the requests in flight have finished; then the generators load its version and it starts;
a version that cannot be loaded fails only its own requests; closing fails what was never sent.
The real backend (generators with vLLM) is exercised in tests/test_api.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from meshrl.api.errors import UserError
from meshrl.api.sampler import PromptOptions, Sampler, continuation_seed
from meshrl.api.types import SamplingParams
from meshrl.engines import Completion, PromptScores, Sampled


class Tokenizer:
    """A vocabulary of 100 in which every stop string is token 1."""

    def encode(self, text, add_special_tokens):
        return [1]

    def __len__(self):
        return 100


class Backend:
    """`hold` and `sample` recorded in order; every `sample` waits for its prompt's release.
    ``mixes_versions``: samples any version without `hold` (recorded with the version it names)."""

    mixes_versions = False

    def __init__(self):
        self.cfg = SimpleNamespace(model=SimpleNamespace(max_model_len=64))
        self.tokenizer = Tokenizer()
        self.events: list[tuple] = []
        self.held = None
        self.released: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def hold(self, version: int) -> None:
        if version == 99:
            raise UserError("the sampler weights of version 99 are no longer kept")
        with self.lock:
            self.events.append(("hold", version))
            self.held = version

    def sample(self, prompt, request, scoring, version) -> Sampled:
        with self.lock:
            self.events.append(("start", prompt[0], version if self.mixes_versions else self.held))
            gate = self.released.setdefault(prompt[0], threading.Event())
        assert gate.wait(timeout=10)
        with self.lock:
            self.events.append(("end", prompt[0]))
        return Sampled([Completion([prompt[0]], [-1.0], "length")])

    def release(self, tag: int) -> None:
        with self.lock:
            self.released.setdefault(tag, threading.Event()).set()

    def started(self) -> list[int]:
        with self.lock:
            return [e[1] for e in self.events if e[0] == "start"]


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def sampler():
    backend = Backend()
    sampler = Sampler(backend)
    yield sampler
    for tag in range(200):
        backend.release(tag)
    sampler.close()


PARAMS = SamplingParams(max_tokens=4)


def test_requests_of_the_held_version_run_together_and_another_version_waits_for_them(sampler):
    backend = sampler.backend
    a1 = sampler.submit(0, [1], 1, PARAMS)
    wait_until(lambda: backend.started() == [1])
    a2 = sampler.submit(0, [2], 1, PARAMS)
    wait_until(lambda: backend.started() == [1, 2])  # both in flight at once
    b = sampler.submit(5, [3], 1, PARAMS)
    a3 = sampler.submit(0, [4], 1, PARAMS)  # held version, but behind a waiting request
    time.sleep(0.1)
    assert backend.started() == [1, 2]
    backend.release(2)
    assert a2.result(timeout=10).sequences[0].tokens == [2]
    time.sleep(0.1)
    assert backend.started() == [1, 2]  # a1 still runs: no version switch under it
    backend.release(1)
    backend.release(3)
    assert b.result(timeout=10).sequences[0].tokens == [3] and a1.done()
    backend.release(4)
    assert a3.result(timeout=10).sequences[0].tokens == [4]
    assert backend.events == [("hold", 0), ("start", 1, 0), ("start", 2, 0), ("end", 2), ("end", 1), ("hold", 5),
                              ("start", 3, 5), ("end", 3), ("hold", 0), ("start", 4, 0), ("end", 4)]


def test_a_version_that_cannot_be_loaded_fails_its_own_requests_only(sampler):
    backend = sampler.backend
    backend.release(1)
    backend.release(2)
    gone = sampler.submit(99, [1], 1, PARAMS)
    fine = sampler.submit(0, [2], 1, PARAMS)
    with pytest.raises(UserError, match="version 99 are no longer kept"):
        gone.result(timeout=10)
    assert fine.result(timeout=10).sequences[0].tokens == [2]


def test_bad_requests_fail_at_once_and_closing_fails_what_was_never_sent(sampler):
    with pytest.raises(UserError, match="topk_sample_logprobs = 65: between 0 and 64"):
        sampler.submit(0, [1], 1, PARAMS, PromptOptions(topk_sample_logprobs=65)).result(timeout=0)
    with pytest.raises(UserError, match=r"target_prompt_logprobs: expected \[len\(prompt\) - 1, K\] = \[1, K >= 1\]"):
        sampler.submit(0, [1, 2], 1, PARAMS, PromptOptions(target_prompt_logprobs=((1,), (2,)))).result(timeout=0)
    running = sampler.submit(0, [7], 1, PARAMS)
    wait_until(lambda: sampler.backend.started() == [7])
    waiting = sampler.submit(3, [8], 1, PARAMS)
    sampler.close()
    with pytest.raises(RuntimeError, match="the sampler is closed"):
        waiting.result(timeout=10)
    with pytest.raises(RuntimeError, match="the sampler is closed"):
        sampler.submit(0, [9], 1, PARAMS).result(timeout=0)
    sampler.backend.release(7)
    assert running.result(timeout=10).sequences[0].tokens == [7]  # in flight: it finishes


def test_one_owners_backlog_delays_another_by_at_most_its_share():
    backend = Backend()
    sampler = Sampler(backend, per_owner=2)
    try:
        flood = [sampler.submit(5, [tag], 1, PARAMS, owner="a") for tag in (1, 2, 3, 4, 6)]
        wait_until(lambda: backend.started() == [1, 2])  # a's share; its other three wait
        quiet = sampler.submit(0, [7], 1, PARAMS, owner="b")  # another version: a switch
        time.sleep(0.1)
        backend.release(1)
        backend.release(2)  # a's running two finish: b's version is loaded before a's backlog runs
        backend.release(7)
        assert quiet.result(timeout=10).sequences[0].tokens == [7]
        for tag in (3, 4, 6):
            backend.release(tag)
        assert [f.result(timeout=10).sequences[0].tokens for f in flood] == [[1], [2], [3], [4], [6]]
        assert backend.events[:3] == [("hold", 5), ("start", 1, 5), ("start", 2, 5)]
        assert sorted(backend.events[3:5]) == [("end", 1), ("end", 2)]  # released together: either order
        assert backend.events[5:8] == [("hold", 0), ("start", 7, 0), ("end", 7)]
        assert backend.events[8] == ("hold", 5)

        same = [sampler.submit(5, [tag], 1, PARAMS, owner="a") for tag in (11, 12, 13)]
        wait_until(lambda: backend.started()[-2:] == [11, 12])
        beside = sampler.submit(5, [14], 1, PARAMS, owner="b")  # the same version: starts at once, beside a's
        wait_until(lambda: backend.started()[-3:] == [11, 12, 14])
        for tag in (11, 12, 13, 14):
            backend.release(tag)
        assert [f.result(timeout=10).sequences[0].tokens for f in (*same, beside)] == [[11], [12], [13], [14]]

        unowned = [sampler.submit(5, [tag], 1, PARAMS) for tag in (15, 16, 17)]  # no owner: no share to keep
        wait_until(lambda: backend.started()[-3:] == [15, 16, 17])
        for tag in (15, 16, 17):
            backend.release(tag)
        assert all(f.result(timeout=10).sequences for f in unowned)
    finally:
        for tag in range(20):
            backend.release(tag)
        sampler.close()


class CountingBackend(Backend):
    """Samples token ``prompt[-1] + 1 + k`` at step k (logprob ``-k``, top-1 itself), stopping on
    token 50; each call recorded as (first prompt token, prompt length, n, max_tokens, seed,
    whether the prompt was scored, version held); a call whose first prompt token is gated waits
    for its release, its continuations do not."""

    def __init__(self, gated=()):
        super().__init__()
        self.calls: list[tuple] = []
        self.versions: list[int] = []  # the version each call named
        self.gated = set(gated)

    def sample(self, prompt, request, scoring, version) -> Sampled:
        with self.lock:
            self.calls.append((prompt[0], len(prompt), request.n, request.max_tokens, request.seed,
                               scoring.logprobs, self.held))
            self.versions.append(version)
            gate = self.released.setdefault(prompt[0], threading.Event()) if prompt[0] in self.gated else None
        if gate is not None:
            assert gate.wait(timeout=10)
            self.gated.discard(prompt[0])
        completions = []
        for j in range(request.n):
            tokens = []
            for k in range(request.max_tokens):
                tokens.append(prompt[-1] + 1 + 3 * j + k)
                if tokens[-1] == 50:
                    break
            completions.append(Completion(tokens, [-float(k) for k in range(len(tokens))],
                                          "stop" if tokens[-1] == 50 else "length",
                                          topk=([[t] for t in tokens], [[0.0]] * len(tokens))))
        scores = PromptScores([-1.0] * (len(prompt) - 1)) if scoring.logprobs else None
        return Sampled(completions, scores)


def test_an_owners_long_request_runs_in_chunks_joined_into_one_response():
    backend = CountingBackend()
    sampler = Sampler(backend, per_owner=4, chunk_tokens=4)
    try:
        params = SamplingParams(max_tokens=10, seed=7)
        out = sampler.submit(0, [1, 2], 2, params, PromptOptions(prompt_logprobs=True, topk_sample_logprobs=1),
                             owner="a").result(timeout=10)
        # sample 0: 3..12 (10 tokens, length); sample 1: 6..15 (10 tokens): both continued twice
        assert [s.tokens for s in out.sequences] == [list(range(3, 13)), list(range(6, 16))]
        assert [s.stop_reason for s in out.sequences] == ["length", "length"]
        assert out.sequences[0].logprobs == [-0.0, -1.0, -2.0, -3.0] * 2 + [-0.0, -1.0]
        assert [t for [(t, _)] in out.sequences[1].topk_logprobs] == list(range(6, 16))
        assert out.prompt_logprobs == [None, -1.0]  # scored once, by the first chunk
        seed_0, seed_1 = continuation_seed(7, 4), continuation_seed(8, 4)
        assert sorted(backend.calls) == sorted([
            (1, 2, 2, 4, 7, True, 0),  # both samples' first chunk, the prompt scored
            (1, 6, 1, 4, seed_0, False, 0), (1, 6, 1, 4, seed_1, False, 0),  # each sample continued alone
            (1, 10, 1, 2, continuation_seed(seed_0, 4), False, 0), (1, 10, 1, 2, continuation_seed(seed_1, 4), False, 0)])

        stopped = sampler.submit(0, [40], 1, SamplingParams(max_tokens=20), owner="a").result(timeout=10)
        assert stopped.sequences[0].tokens == list(range(41, 51)) and stopped.sequences[0].stop_reason == "stop"
        whole = sampler.submit(0, [30], 1, SamplingParams(max_tokens=8)).result(timeout=10)  # no owner: one piece
        assert whole.sequences[0].tokens == list(range(31, 39)) and backend.calls[-1][3] == 8
    finally:
        sampler.close()


def test_another_owners_request_waits_for_one_chunk_not_for_a_whole_long_request():
    backend = CountingBackend(gated=[1])
    sampler = Sampler(backend, per_owner=4, chunk_tokens=4)
    try:
        long = sampler.submit(5, [1], 1, SamplingParams(max_tokens=12), owner="a")
        wait_until(lambda: len(backend.calls) == 1)
        quiet = sampler.submit(0, [20], 1, SamplingParams(max_tokens=2), owner="b")  # another version
        backend.release(1)  # a's first chunk ends: b's version is loaded before a's request goes on
        assert quiet.result(timeout=10).sequences[0].tokens == [21, 22]
        assert long.result(timeout=10).sequences[0].tokens == list(range(2, 14))
        assert [(c[0], c[1], c[6]) for c in backend.calls] == [(1, 1, 5), (20, 1, 0), (1, 5, 5), (1, 9, 5)]
        assert [e for e in backend.events if e[0] == "hold"] == [("hold", 5), ("hold", 0), ("hold", 5)]
    finally:
        sampler.close()


def test_with_versions_mixed_every_version_runs_at_once_uncut_under_its_owners_share():
    """A backend whose generators apply each version's adapter per request: another owner's request
    on another version starts beside a flood at once (no hold, no waiting for a chunk), requests
    run in one piece, and an owner's backlog still waits for its own share only."""
    backend = CountingBackend(gated=[1, 2, 3])
    backend.mixes_versions = True
    sampler = Sampler(backend, per_owner=2, chunk_tokens=4, hold_s=0.5, turn_s=5)
    try:
        flood = [sampler.submit(5, [tag], 1, SamplingParams(max_tokens=12), owner="a") for tag in (1, 2, 3)]
        wait_until(lambda: len(backend.calls) == 2)  # a's share; its third waits behind its own two
        quiet = sampler.submit(0, [20], 1, SamplingParams(max_tokens=2), owner="b")
        assert quiet.result(timeout=10).sequences[0].tokens == [21, 22]  # while a's two still run
        assert not any(f.done() for f in flood) and len(backend.calls) == 3
        for tag in (1, 2, 3):
            backend.release(tag)
        assert [f.result(timeout=10).sequences[0].tokens for f in flood] == [list(range(t + 1, t + 13)) for t in (1, 2, 3)]
        assert [(c[0], c[3]) for c in backend.calls] == [(1, 12), (2, 12), (20, 2), (3, 12)]  # whole: no chunks
        assert backend.versions == [5, 5, 0, 5] and not [e for e in backend.events if e[0] == "hold"]
    finally:
        sampler.close()


def test_the_held_version_waits_a_moment_for_its_owners_next_request_but_never_for_a_backlog():
    """`hold_s`: b's request on version 0 finishes while a's flood waits on version 5; b has
    nothing else waiting, so the generators keep version 0 for b's next request, which starts with
    no weight load. A hold that sees no request switches when it ends; a's backlog is not waited
    for: its version is switched away from as soon as its running requests end."""
    backend = Backend()
    sampler = Sampler(backend, per_owner=1, hold_s=0.5, turn_s=30.0)
    try:
        first = sampler.submit(0, [1], 1, PARAMS, owner="b")
        wait_until(lambda: backend.started() == [1])
        flood = [sampler.submit(5, [tag], 1, PARAMS, owner="a") for tag in (10, 11, 12)]
        backend.release(1)
        first.result(timeout=10)
        second = sampler.submit(0, [2], 1, PARAMS, owner="b")  # within the hold: no switch
        wait_until(lambda: backend.started() == [1, 2])
        assert ("hold", 5) not in backend.events
        started = time.monotonic()
        backend.release(2)
        second.result(timeout=10)
        wait_until(lambda: ("hold", 5) in backend.events)  # no third request: the hold ends, a's version loads
        assert time.monotonic() - started >= 0.4
        wait_until(lambda: backend.started()[-1] == 10)
        quiet = sampler.submit(0, [3], 1, PARAMS, owner="b")
        backend.release(10)  # a's running request ends; a has two more waiting: b's version loads at once
        wait_until(lambda: backend.started()[-1] == 3)
        assert backend.events[-2:] == [("hold", 0), ("start", 3, 0)]
        backend.release(3)
        quiet.result(timeout=10)
        for tag in (11, 12):
            backend.release(tag)
        assert [f.result(timeout=10).sequences[0].tokens for f in flood] == [[10], [11], [12]]
        assert backend.events.count(("hold", 0)) == 2 and backend.events.count(("hold", 5)) == 2
    finally:
        for tag in range(20):
            backend.release(tag)
        sampler.close()


def test_a_request_sent_the_moment_the_last_answer_arrives_finds_the_version_held():
    """A client's next request can arrive as soon as its last answer does: here it is sent from the
    answer's callback, in the sampler's own thread. The sampler has by then freed the last
    request's slot and begun the hold, so the request starts on the held version with no load,
    and a's waiting version loads after it."""
    backend = Backend()
    sampler = Sampler(backend, per_owner=1, hold_s=5.0, turn_s=30.0)
    try:
        first = sampler.submit(0, [1], 1, PARAMS, owner="b")
        wait_until(lambda: backend.started() == [1])
        other = sampler.submit(5, [9], 1, PARAMS, owner="a")
        following = []
        first.add_done_callback(lambda _: following.append(sampler.submit(0, [2], 1, PARAMS, owner="b")))
        backend.release(1)
        wait_until(lambda: backend.started() == [1, 2])
        assert ("hold", 5) not in backend.events
        backend.release(2)
        backend.release(9)
        assert following[0].result(timeout=10).sequences[0].tokens == [2]
        assert other.result(timeout=10).sequences[0].tokens == [9]
        assert backend.events.index(("hold", 5)) > backend.events.index(("end", 2))
    finally:
        for tag in range(20):
            backend.release(tag)
        sampler.close()


def test_a_version_keeps_the_generators_by_waiting_for_at_most_its_turn():
    """`turn_s`: an owner that sends one request after another keeps its version only while its
    turn lasts; then the waiting version loads before the owner's next request runs."""
    backend = Backend()
    sampler = Sampler(backend, per_owner=1, hold_s=8.0, turn_s=1.5)
    try:
        for tag in range(20):
            backend.release(tag)
        sampler.submit(0, [1], 1, PARAMS, owner="b").result(timeout=10)
        other = sampler.submit(5, [9], 1, PARAMS, owner="a")
        started, sent = time.monotonic(), 0
        while not other.done():
            sampler.submit(0, [2], 1, PARAMS, owner="b").result(timeout=10)
            sent += 1
            assert time.monotonic() - started < 8, "the waiting version never loaded"
        assert other.result(timeout=10).sequences[0].tokens == [9]
        assert time.monotonic() - started < 6.0  # the turn (1.5 s), not the hold (8 s)
        assert sent > 2  # b's requests ran without switches while its turn lasted
        assert backend.events.index(("hold", 5)) > backend.events.index(("start", 2, 0)) + 2 * 2
    finally:
        sampler.close()
