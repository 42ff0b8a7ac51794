"""Every call the controller makes on an actor mesh, in one place.

Each call is issued on the mesh's current actors, waited for with a deadline while the serving
processes are watched, and recovered through the supervisor (replace the mesh, re-sync it, issue
the call again). Work is split over a mesh's replicas here, so the loop, the rollout strategies and
the loss terms only say what they want (generate, score, step environments, train, publish, pull).
Generation and scoring go out in chunks to whichever replica is free, with hedging
(meshrl.meshes.dispatch).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from typing import Any, Callable

from meshrl.config.meshes import GENERATOR, LEARNER, REWARDER
from meshrl.meshes.dispatch import Dispatcher
from meshrl.meshes.group import first_line
from meshrl.meshes.supervisor import Supervisor, process_errors, wait_all
from meshrl.engines import Completion, PromptScoring, SampleRequest, Sampled
from meshrl.engines.vllm_loop import EngineFailed
from meshrl.losses import get_loss
from meshrl.meshes.ranks import actor_at, reply_at
from meshrl.training.policy import combine_metrics
from meshrl.types import AdamParams, Datum, LossPart


class StepError(RuntimeError):
    """A step cannot proceed; the message names the mesh and the call."""


class RequestFailed(RuntimeError):
    """A generator refused or failed one sampling request and serves on: the request's own fault."""


class RequestLost(RuntimeError):
    """The generator serving a sampling request died, hung or broke while it ran; it was replaced,
    and the request is not issued again."""


def split_by_tokens(datums: list[Datum], parts: int, per_item: int = 1) -> list[list[int]]:
    """Datum indices for each of ``parts`` ranks, balanced by token count (the longest item goes
    to the rank with the fewest tokens so far), items of ``per_item`` consecutive datums kept
    whole, each share in datum order. With fewer items than ranks some shares are empty."""
    items = [list(range(i, min(i + per_item, len(datums)))) for i in range(0, len(datums), per_item)]
    items.sort(key=lambda item: -sum(datums[i].length for i in item))
    shares: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for item in items:
        r = min(range(parts), key=lambda k: (load[k], k))
        shares[r].extend(item)
        load[r] += sum(datums[i].length for i in item)
    return [sorted(share) for share in shares]


def _combine(replies: list[tuple[list[int], dict]]) -> dict:
    """One forward_backward result from the ranks' replies: summed loss and tokens, token-weighted
    means of the other metrics, the slowest rank's seconds."""
    parts = [reply for _, reply in replies]
    out = combine_metrics([(p["tokens"], p) for p in parts])
    out.update(tokens=sum(p["tokens"] for p in parts), seconds=max(p["seconds"] for p in parts))
    return out


def prompts_by_replica(completions: list[list[Completion]]) -> dict[str, int]:
    """`gen/prompts/replica<r>`: how many prompts each generator replica served (a step sums its
    calls'; the loop reports the largest share as `gen/replica_max_share`)."""
    counts = Counter(group[0].meta["replica"] for group in completions if group)
    return {f"gen/prompts/replica{r}": n for r, n in sorted(counts.items())}


class MeshClient:
    """Supervised calls on the run's meshes, safe to use from the producer thread and the learner
    side at once. ``step`` (per thread) is what fault injection keys on; ``readers`` are the meshes
    that pull every published weight version."""

    def __init__(self, meshes, supervisor: Supervisor, timeouts: dict[str, float], chunks_per_replica: int,
                 faults=None):
        self.meshes = meshes
        self.sup = supervisor
        self.timeouts = timeouts  # the deadline of one call, per mesh, and "sync" for weight pulls
        self.chunks_per_replica = chunks_per_replica  # meshes.chunks_per_replica
        self.faults = faults
        self._dispatchers: dict[str, Dispatcher] = {}  # per mesh: what each replica still works on
        self._local = threading.local()  # the producer and the learner side each work on their own step
        self.version = 0  # the latest weight version every reader holds
        # publishing and pulling never interleave, so all readers always pull one version together;
        # re-entrant: a reader replaced during a pull re-syncs inside it
        self._sync_lock = threading.RLock()
        self._lock = threading.Lock()
        self._sampling: Counter[int] = Counter()  # per generator rank: `sample` calls in flight
        self.readers: list[str] = []
        self.add_reader(GENERATOR)

    @property
    def step(self) -> int:
        """The step this thread's calls work for (what fault injection keys on)."""
        return getattr(self._local, "step", 0)

    @step.setter
    def step(self, value: int) -> None:
        self._local.step = value

    def procs(self, mesh: str) -> int:
        return self.meshes.procs_of(mesh)

    def add_reader(self, mesh: str) -> None:
        """``mesh`` pulls each published version; a replacement pulls the current one at once."""
        self.readers.append(mesh)
        # a replacement brings every reader to the newest published version (asynchronous runs
        # publish ahead of the readers' last pull), so they keep holding one version together
        self.sup.on_respawn(mesh, lambda: self.sync_readers(self.version))

    def call(self, mesh: str, phase: str, issue: Callable[[Any], list], what: str,
             timeout_s: float | None = None) -> list:
        """``issue(actor_mesh)`` returns futures; wait for all with one deadline; on failure the
        supervisor replaces the mesh and the call is issued again."""
        return self._attempts(mesh, phase, what, lambda: self.unsupervised(mesh, issue, what, timeout_s))

    def _attempts(self, mesh: str, phase: str, what: str, fn: Callable[[], Any]):
        """``fn()`` under the supervisor, fault injection armed before each attempt."""

        def attempt():
            if self.faults is not None:
                self.faults.before_call(self.step, mesh, phase)
            return fn()

        return self.sup.run(mesh, attempt, what)

    def _dispatcher(self, mesh: str) -> Dispatcher:
        return self._dispatchers.setdefault(mesh, Dispatcher())

    def unsupervised(self, mesh: str, issue: Callable[[Any], list], what: str, timeout_s: float | None = None) -> list:
        """Issue and wait with the deadline while watching the serving processes, without recovery:
        for calls made during a recovery, or whose failure the caller handles itself."""
        return wait_all(issue(self.meshes[mesh]), timeout_s or self.timeouts[mesh], what,
                        watch=lambda: self.meshes.dead_process(mesh))

    def supervised(self, mesh: str, fn: Callable[[], Any], what: str):
        """Run ``fn`` (a whole exchange with ``mesh``) again from the start if ``mesh`` fails."""
        return self.sup.run(mesh, fn, what)

    def per_rank(self, mesh: str, endpoint: str, args_by_rank: dict[int, Any]) -> dict[int, Any]:
        """``endpoint(args)`` on each listed rank of ``mesh``; replies by rank. Waits with the
        deadline only: the caller supervises the whole exchange (see :meth:`supervised`)."""
        ranks = sorted(args_by_rank)
        replies = self.unsupervised(
            mesh, lambda actors: [getattr(actor_at(actors, r), endpoint).call_one(args_by_rank[r]) for r in ranks],
            f"{mesh}.{endpoint}")
        return dict(zip(ranks, replies))

    # ---- generation and rewards -------------------------------------------------------------
    def dispatch(self, mesh: str, phase: str, n: int, issue: Callable[[Any, int, int], Any], what: str) -> list:
        """Items ``[0, n)`` over ``mesh``'s replicas in chunks, to whichever replica is free, the
        last ones hedged (meshrl.meshes.dispatch); ``issue(replica_actor, start, stop)`` returns
        a chunk's future. Supervised like :meth:`call`; each chunk's reply, in order."""
        dispatcher = self._dispatcher(mesh)
        return self._attempts(mesh, phase, what, lambda: dispatcher.run(
            self.meshes[mesh], self.procs(mesh), n, self.chunks_per_replica, issue, self.timeouts[mesh], what,
            watch=lambda: self.meshes.dead_process(mesh)))

    def generate(self, prompts: list[list[int]], request: SampleRequest,
                 timings: dict[str, float] | None = None) -> list[list[Completion]]:
        """Completions per prompt, in order, from the generator replicas. Prompt i of the batch is
        sampled with seed + i whichever replica serves it: a chunk from prompt i gets seed + i, and
        the vLLM engine adds each prompt's index in the chunk (the HF engine seeds the chunk once;
        chunks are cut the same way in every run, see `chunk_bounds`). ``timings`` gets
        `timing/generator_engine_s` added: the engine time of the busiest replica, as timed inside
        the generators (the rest of the call's time is transport and dispatch)."""
        if not prompts:
            return []

        def chunk(generator, start: int, stop: int):
            part = request if request.seed is None else dataclasses.replace(request, seed=request.seed + start)
            return generator.generate.call_one(prompts[start:stop], part)

        batches = self.dispatch(GENERATOR, "generate", len(prompts), chunk, "generator.generate")
        if timings is not None:
            busiest = Counter()
            for b in batches:
                busiest[b.replica] += b.seconds
            key = "timing/generator_engine_s"
            timings[key] = timings.get(key, 0.0) + max(busiest.values())
        return [group for batch in batches for group in batch.completions]

    def sample(self, prompt: list[int], request: SampleRequest, scoring: PromptScoring,
               version: int | None = None) -> Sampled:
        """One prompt's samples from the generator replica with the fewest requests in flight
        (under weight ``version``'s adapter beside other versions: `generator.lora_slots`),
        answered when that request is done: it runs in the engine beside the others in flight
        (continuous batching with vLLM). Safe to call from many threads at once.

        A generator found dead before the request is sent is replaced first. An exception the
        generator raises for this request alone fails it with `RequestFailed` and leaves the
        generator serving. A generator that dies, hangs past the deadline or whose engine fails
        while the request runs is replaced (once for all the calls it failed), and the request
        fails with `RequestLost` naming the cause: it is not issued again, since it may be what
        broke the generator."""
        sup = self.sup
        seen = sup.replacements(GENERATOR)
        dead = self.meshes.dead_process(GENERATOR)
        if dead:
            sup.recover_unless_replaced(GENERATOR, seen, f"generator.sample: {dead}")
            seen = sup.replacements(GENERATOR)
        if self.faults is not None:
            self.faults.before_call(self.step, GENERATOR, "generate")
        with self._lock:
            busy = self._sampling
            rank = min(range(self.procs(GENERATOR)), key=lambda r: (busy[r], r))
            busy[rank] += 1
        try:
            [sampled] = self.unsupervised(GENERATOR, lambda actors: [
                actor_at(actors, rank).sample.call_one(prompt, request, scoring, version)], "generator.sample")
            return sampled
        except (EngineFailed, *process_errors()) as e:  # the generator is unusable: replace it
            cause = f"generator.sample: {first_line(e)}"
            sup.recover_unless_replaced(GENERATOR, seen, cause)
            raise RequestLost(f"{cause} (the generator was replaced; this request is not issued again)") from None
        except Exception as e:  # noqa: BLE001 - raised for this request alone; the generator serves on
            raise RequestFailed(f"{type(e).__name__}: {first_line(e)}") from None
        finally:
            with self._lock:
                busy[rank] -= 1

    def score(self, items: list[tuple[Any, str]]) -> list[tuple[float, dict]]:
        """(reward, info) per (problem, response text), from the rewarder replicas."""
        if not items:
            return []
        scored = self.dispatch(REWARDER, "score", len(items),
                               lambda rewarder, start, stop: rewarder.score.call_one(items[start:stop]),
                               "rewarder.score")
        return [s for part in scored for s in part]

    # ---- the learner ------------------------------------------------------------------------
    def on_learners(self, endpoint: str, *args, supervised: bool = True, timeout_s: float | None = None):
        """``endpoint(*args)`` on every learner rank (data-parallel ranks take part together);
        rank 0's reply. ``supervised=False`` for calls outside the loop's recovery."""
        def issue(m):
            return [getattr(m, endpoint).call(*args)]

        what = f"learner.{endpoint}"
        if supervised:
            replies = self.call(LEARNER, "train", issue, what, timeout_s)[0]
        else:
            replies = self.unsupervised(LEARNER, issue, what, timeout_s)[0]
        return reply_at(replies, 0)

    def _split_learners(self, endpoint: str, datums: list[Datum], per_item: int, *args, **kwargs) -> list:
        """``endpoint(share, *args, padding, **kwargs)`` on every learner rank with its share of ``datums``
        (balanced by tokens, items of ``per_item`` datums kept whole); replies of the ranks that got
        real datums, with their shares' datum indices."""
        shares = split_by_tokens(datums, self.procs(LEARNER), per_item)

        def issue(m):
            return [getattr(actor_at(m, r), endpoint).call_one(
                [datums[i] for i in (idx or range(min(per_item, len(datums))))], *args, bool(datums) and not idx,
                **kwargs)
                for r, idx in enumerate(shares)]

        replies = self.call(LEARNER, "train", issue, f"learner.{endpoint}")
        return [(idx, reply) for idx, reply in zip(shares, replies) if idx or not datums]

    def forward_backward(self, datums: list[Datum], loss_fn: str, loss_fn_config: dict | None = None,
                         temperature: float = 1.0) -> dict:
        """``loss_fn`` on the learner ranks' shares, the datums' log-probabilities taken at the
        ``temperature`` their tokens were sampled at."""
        per_item = get_loss(loss_fn).datums_per_item
        return _combine(self._split_learners("forward_backward", datums, per_item, loss_fn, loss_fn_config,
                                             temperature=temperature))

    def forward_backward_parts(self, parts: list[LossPart]) -> list[dict]:
        """Several losses, each on its own datums (every part has some), in one set of shared
        micro-batches on the learner ranks: each part's datums are shared out among the ranks like
        `forward_backward`'s, a rank with none of any part keeps in step with padding datums; each
        part's result combined over the ranks that trained it."""
        n = self.procs(LEARNER)
        shares = [split_by_tokens(p.datums, n, get_loss(p.loss_fn).datums_per_item) for p in parts]
        mine = [[k for k in range(len(parts)) if shares[k][r]] for r in range(n)]
        first = parts[0]
        padding = dataclasses.replace(first, datums=first.datums[: get_loss(first.loss_fn).datums_per_item])

        def issue(m):
            return [actor_at(m, r).forward_backward_parts.call_one(
                [dataclasses.replace(parts[k], datums=[parts[k].datums[i] for i in shares[k][r]]) for k in ks]
                or [padding], not ks) for r, ks in enumerate(mine)]

        replies = self.call(LEARNER, "train", issue, "learner.forward_backward_parts")
        by_part: list[list] = [[] for _ in parts]
        for ks, reply in zip(mine, replies):
            for k, result in zip(ks, reply):
                by_part[k].append((shares[k], result))
        return [_combine(results) for results in by_part]

    def forward_backward_custom(self, datums: list[Datum], fn) -> dict:
        """A picklable ``fn(datums, logprobs) -> (loss, metrics)`` on each rank's share: with more
        than one learner process it must be a sum over datums to equal the 1-process result."""
        return _combine(self._split_learners("forward_backward_custom", datums, 1, fn))

    def _per_datum(self, endpoint: str, datums: list[Datum], *args, **kwargs) -> list:
        """``endpoint`` (one reply item per datum) on the learner ranks' shares; items in datum order."""
        out: list = [None] * len(datums)
        for idx, items in self._split_learners(endpoint, datums, 1, *args, **kwargs):
            for i, item in zip(idx, items):
                out[i] = item
        return out

    def forward(self, datums: list[Datum], reference: bool = False, temperature: float = 1.0) -> list[list[float]]:
        return self._per_datum("forward", datums, reference, temperature=temperature)

    def topk_logprobs(self, datums: list[Datum], k: int, min_prefix: int = 0) -> list[tuple]:
        """Per datum, the learner's top-``k`` (indices, log-probs) at its `mask` positions and its
        own tokens' log-probs there, shared prefixes of ``min_prefix`` tokens or more forwarded once."""
        return self._per_datum("topk_logprobs", datums, k, min_prefix=min_prefix)

    def scale_grads(self, factor: float) -> None:
        self.on_learners("scale_grads", factor)

    def optim_step(self, adam: AdamParams) -> dict:
        return self.on_learners("optim_step", adam)

    # ---- weights ------------------------------------------------------------------------------
    def publish(self, version: int) -> dict:
        with self._sync_lock:
            return self.on_learners("publish", version)

    def _pull(self, mesh: str, version: int) -> list[dict]:
        """Every replica of ``mesh`` pulls ``version``; the free ones' statistics. A replica still busy
        with a late duplicate loads the version before it serves anything else (its reply is checked
        when it arrives), so a slow replica does not hold the sync."""
        what = f"{mesh}.update_weights"

        def check(pull: dict) -> None:
            if pull["version"] < version:
                raise StepError(f"{what}: a replica holds version {pull['version']} after a pull of {version}")

        dispatcher = self._dispatcher(mesh)
        return self.call(mesh, "sync", lambda m: dispatcher.send_all(
            m, self.procs(mesh), lambda replica: replica.update_weights.call_one(version), check,
            self.timeouts["sync"], what, watch=lambda: self.meshes.dead_process(mesh)), what, self.timeouts["sync"])

    def sync_readers(self, version: int) -> dict[str, list[dict]]:
        """Every weight reader pulls the newest published version, at least ``version``, all the
        same one (nothing is published meanwhile); each reader mesh's pull statistics, with the
        seconds its whole pull took (`mesh_s`). A replica busy with a late duplicate pulls when it
        has finished it, before serving anything else."""
        with self._sync_lock:
            stats = {}
            for mesh in self.readers:
                started = time.perf_counter()
                pulls = self._pull(mesh, version)
                stats[mesh] = [{**p, "mesh_s": time.perf_counter() - started} for p in pulls]
            held = {p["version"] for pulls in stats.values() for p in pulls}
            if len(held) != 1 or min(held) < version:
                raise StepError(f"weight readers hold versions {sorted(held)} after a pull of {version}, expected "
                                f"one version >= {version}")
            self.version = held.pop()
            return stats
