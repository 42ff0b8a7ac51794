"""The trace-replay DPO term (channel 3): submit frozen traces to the pool of TeacherReplayActors,
drain their delayed results without waiting, and turn agreed-on teacher actions into `dpo` Datums
for the learner (a chosen and a rejected answer per pair). A generation job (`diloco.role:
generate`) trains nothing: it exports the pairs with its rollout shards instead; a learner of
shards (`learn`) trains on the pairs that arrive in the shards (`ShardPairsTerm`), with no teachers
of its own.

Training never waits on teachers: `submit` returns once the actors have queued the work and
`drain` only takes what has already arrived. A step submits at most `replay.traces_per_step`
traces, shared fairly among its units as they arrive (`unit_quota`) and spread over each unit's
groups (`spread_over_groups`); what the budget leaves out is counted (`replay/skipped_budget`).
Pairs wait in a bounded buffer and are checked for age again when their turn comes. With
`replay.reference.source: precomputed` a pair's two reference log-probabilities are computed once,
before it enters the buffer, by the reference actor (meshrl.actors.reference, the initial weights in
`model.dtype` on a mesh of its own) in a call that runs beside the steps (no step waits for it),
and its datums carry them: the learner's step runs no reference forward and holds no frozen copy
of the model. The pool is supervised like any mesh; a replaced pool
is re-subscribed to the inbox and given back the work it had not delivered, and the inbox's dedupe
makes sure each trace's result is used once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from meshrl.actors.teacher_replay import producer_name
from meshrl.config.meshes import REPLAY_REFERENCE
from meshrl.config.meshes import TEACHER_REPLAY as POOL
from meshrl.meshes.dispatch import split_evenly
from meshrl.meshes.placement import replay_reference_mesh
from meshrl.meshes.ranks import actor_at
from meshrl.replay.pairs import PreferenceItem, dpo_datums, pair_record
from meshrl.terms.base import LossTerm, StepOutput, TermContext
from meshrl.training.trajectories import groups_of
from meshrl.types import Datum, LossPart

log = logging.getLogger(__name__)


def unit_quota(budget: int, sent: int, unit_index: int, units_per_step: int) -> int:
    """Traces unit ``unit_index`` (0-based) of a step may submit: an equal share, rounded up, of
    what the step's ``budget`` has left after ``sent`` among the units still to come (a unit
    beyond the expected ``units_per_step``, e.g. a dynamic-sampling round, may take all of it)."""
    left = max(0, budget - sent)
    return -(-left // max(1, units_per_step - unit_index))


def spread_over_groups(trajectories: list, n: int) -> list:
    """Up to ``n`` of ``trajectories``, taken in turns across their groups (every group's first,
    then every group's second, ...), so that a budget covers as many prompts as it can."""
    groups = [[trajectories[i] for i in idx] for idx in groups_of(trajectories).values()]
    turns = [g[rank] for rank in range(max(map(len, groups), default=0)) for g in groups if rank < len(g)]
    return turns[:n]


@dataclass
class PendingTrace:
    """What the controller keeps for a submitted trace until its result arrives."""

    trace: object
    version: int
    producer: str
    steps: list[tuple[list[int], list[int]]]
    """Per student step: (the exact tokens before the step's reply, the reply's tokens)."""
    submitted_at: float = 0.0
    attempts: int = 1


class PairsTerm(LossTerm):
    """DPO on buffered preference pairs: at most `replay.max_pairs_per_step` a step, oldest first,
    each weighted weight / pairs, so the term is `replay.beta` times the mean over the pairs the
    step trains (however few: a lone pair weighs as much as a full step's pairs together)."""

    name, prefix, loss = "replay_dpo", "dpo", "dpo"

    def __init__(self, ctx: TermContext, weight: float | None = None, params=None):
        super().__init__(ctx, ctx.cfg.replay.beta if weight is None else weight, params)
        self.cfg = ctx.cfg.replay
        self.buffer: list[PreferenceItem] = []

    def loss_config(self) -> dict:
        return {"beta": self.cfg.dpo_beta}

    def take(self, n: int) -> list[PreferenceItem]:
        """Up to ``n`` buffered pairs, oldest first."""
        items, self.buffer = self.buffer[:n], self.buffer[n:]
        return items

    def step_datums(self) -> list[Datum]:
        """The `dpo` Datums of the step's pairs, taken from the buffer."""
        items = self.take(self.cfg.max_pairs_per_step)
        return dpo_datums(items, self.weight / len(items)) if items else []


class ReplayTerm(PairsTerm):
    """Submits traces, drains pairs, buffers DPO items; its state goes into checkpoints. Every pair
    the teachers agreed on becomes a record of `pairs.jsonl` (`take_records`)."""

    records_file = "pairs.jsonl"

    def __init__(self, ctx: TermContext, weight: float | None = None, params=None):
        from meshrl.transport.delayed import DelayedInbox

        super().__init__(ctx, weight, params)
        self.trains = ctx.cfg.diloco.role != "generate"  # a generation job exports its pairs instead
        self.renderer = ctx.renderer
        self.stop_token = self.renderer.get_stop_sequences()[0]
        self.inbox = DelayedInbox()
        self.in_flight: dict[str, PendingTrace] = {}
        self.counts: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.producers = [producer_name(POOL, r) for r in range(self.cfg.pool.procs)]
        tc = ctx.cfg.trainer
        self.units_per_step = tc.num_substeps * tc.num_minibatches
        self.unit_index = 0  # the step's units received so far
        self.sent_this_step = 0  # traces the step has submitted
        self.step = 0
        self.records: list[dict] = []
        self.precomputed = replay_reference_mesh(ctx.cfg)
        """Whether pairs get their reference log-probabilities from the reference mesh as they arrive."""
        beside = self.precomputed and self.cfg.reference.beside_the_step
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="replay-reference") if beside else None
        self.scoring: tuple[Future, list[PreferenceItem]] | None = None  # the scoring call running
        self.unscored: list[PreferenceItem] = []  # arrived while it runs: the next call's pairs
        self._subscribe()
        self.client.sup.on_respawn(POOL, self._after_respawn)

    @classmethod
    def spawn(cls, session, cfg) -> None:
        from meshrl.actors.teacher_replay import TeacherReplayActor

        session.spawn(POOL, TeacherReplayActor, cfg.replay.teachers, cfg.replay.pool, POOL, procs=cfg.replay.pool.procs,
                      timeout_s=cfg.replay.pool.rpc_timeout_s)
        if replay_reference_mesh(cfg):
            from meshrl.actors.reference import ReferenceActor

            ref = cfg.replay.reference
            session.spawn(REPLAY_REFERENCE, ReferenceActor, str(session.model_path), cfg.model.dtype,
                          cfg.learner.torch_threads, procs=ref.mesh.procs, colocate_with=ref.mesh.colocate_with,
                          timeout_s=ref.call_timeout_s)

    # ---- remote helpers --------------------------------------------------------------------
    def _call(self, what: str, issue):
        return self.client.call(POOL, what, issue, f"{POOL}.{what}", self.cfg.pool.rpc_timeout_s)

    def _subscribe(self) -> None:
        port = self.inbox.port
        self._call("subscribe", lambda pool: [pool.subscribe.call(port)])

    def _after_respawn(self) -> None:
        """A fresh pool: charge it with the spend so far, subscribe it and give it back every
        trace not yet delivered."""
        def wait(issue, what):
            return self.client.unsupervised(POOL, issue, f"{POOL}.{what}", self.cfg.pool.rpc_timeout_s)

        spent = self.outcomes["replay/cost_usd"]
        if spent > 0:  # spend of calls whose results never arrived is unknown (at most the in-flight traces)
            charged = wait(lambda pool: [pool.carry_spend.call(spent / len(self.producers))], "carry_spend")
            self.counts["spend_carried_usd"] = sum(charged[0].values())
        wait(lambda pool: [pool.subscribe.call(self.inbox.port)], "subscribe")
        keys = [k for k in self.inbox.outstanding() if k in self.in_flight]
        wait(lambda pool: [self._actor(pool, self.in_flight[k].producer).submit.call_one(
            k, self.in_flight[k].trace, self.in_flight[k].version) for k in keys], "submit")
        self.counts["resubmitted"] += len(keys)

    def _actor(self, pool, producer: str):
        return actor_at(pool, self.producers.index(producer))

    # ---- the term -----------------------------------------------------------------------------
    def start_step(self, step: int) -> None:
        self.unit_index = self.sent_this_step = 0
        self.step, self.records = step, []  # records of a step that did not finish are made again

    def take_records(self) -> list[dict]:
        records, self.records = self.records, []
        return records

    def receive(self, unit) -> None:
        """Queue the unit's share of the step's traces for replay (never waits for the teachers)."""
        quota = unit_quota(self.cfg.traces_per_step, self.sent_this_step, self.unit_index, self.units_per_step)
        self.unit_index += 1
        self.sent_this_step += self.submit(unit.sampled, quota)

    def finish(self, version: int, metrics: dict) -> LossPart | None:
        """The pairs that arrived (at most `max_pairs_per_step`) as the step's DPO term."""
        if not self.trains:
            return None
        datums, counts = self.datums(version)
        metrics.update(counts)
        return self.part(datums)

    def end_step(self, output: StepOutput, metrics: dict) -> None:
        """A generation job: every pair that arrived goes out with the step's groups."""
        if not self.trains:
            metrics.update(self.drain(output.published))
            output.pairs += self.take(len(self.buffer))

    def submit(self, trajectories: list, quota: int) -> int:
        """Queue up to ``quota`` of the selected trajectories for replay, spread over their groups,
        each under the version that sampled it (never waits for the teachers); those left out are
        counted (`skipped_budget`, `skipped_backpressure`). Returns how many were submitted."""
        from meshrl.sdpo.sites import error_kind  # the same notion of a failed trajectory as SDPO

        selected = [t for t in trajectories if t.tokens and (self.cfg.select == "all" or error_kind(t.info))]
        self.counts["skipped_budget"] += max(0, len(selected) - quota)
        room = max(0, self.cfg.max_outstanding - len(self.inbox.outstanding()))
        self.counts["skipped_backpressure"] += max(0, min(len(selected), quota) - room)
        chosen = spread_over_groups(selected, min(quota, room))
        keys = [f"v{t.version}/{t.id}" for t in chosen]
        for i, (key, t) in enumerate(zip(keys, chosen)):
            producer = self.producers[(self.counts["submitted"] + i) % len(self.producers)]
            trace, steps = self._frozen_trace(t)
            self.in_flight[key] = PendingTrace(trace, t.version, producer, steps, time.monotonic())
            self.inbox.expect(key, producer)
        if not chosen:
            return 0
        self._call("submit", lambda pool: [self._actor(pool, self.in_flight[k].producer).submit.call_one(
            k, self.in_flight[k].trace, self.in_flight[k].version) for k in keys])
        self.counts["submitted"] += len(chosen)
        return len(chosen)

    def _frozen_trace(self, t):
        """The trace teachers replay (the exact contexts the student saw) and, per step, its tokens."""
        from meshrl.replay.trace import Trace, TraceStep

        turns = t.info.get("turns")
        if not turns:  # single turn: the prompt messages as the template renders them
            turns = [(self.renderer.conversation_messages(list(t.problem.messages)), t.response_text, 0, len(t.tokens))]
        steps = [TraceStep(context=list(context), action=text) for context, text, _, _ in turns]
        tokens = [(list(t.prompt_tokens) + list(t.tokens[:start]), list(t.tokens[start:end]))
                  for _, _, start, end in turns]
        return Trace(episode_id=t.id, steps=steps), tokens

    def _reference_values(self, items: list[PreferenceItem]) -> tuple[list[list[float]], float]:
        """Each pair's reference log-probabilities (chosen, rejected) from the reference mesh, in
        one supervised call with `replay.reference.call_timeout_s`, and the call's seconds. Reads
        the items only (it runs beside the step, in the scoring thread)."""
        started = time.perf_counter()
        parts = split_evenly(items, self.client.procs(REPLAY_REFERENCE))
        temperature = self.logprob_temperature()

        def issue(actors):
            return [actor_at(actors, r).score_pairs.call_one([(i.prompt, i.chosen, i.rejected) for i in part],
                                                             temperature) for r, part in enumerate(parts)]

        replies = self.client.call(REPLAY_REFERENCE, "replay_reference", issue, f"{REPLAY_REFERENCE}.score_pairs",
                                   self.cfg.reference.call_timeout_s)
        references = [ref for reply in replies for ref in reply["references"]]
        if len(references) != len(items) or any(len(r) != 2 for r in references):
            raise RuntimeError(f"{REPLAY_REFERENCE}.score_pairs: {len(references)} replies for {len(items)} pairs")
        return [[float(ref[0]), float(ref[1])] for ref in references], time.perf_counter() - started

    def _set_references(self, items: list[PreferenceItem], values: list[list[float]]) -> None:
        for item, value in zip(items, values):
            item.reference = value
        self.counts["reference_scored"] += len(items)

    def _score_beside_the_step(self, arrived: list[PreferenceItem]) -> float:
        """Pairs enter the buffer once scored, and the step never waits for the scoring: each drain
        moves the pairs whose call has returned into the buffer (in arrival order; a failed call
        raises here) and, when no call is running, starts one for every pair that arrived since
        (so at most one runs). Returns the seconds of the calls that returned."""
        self.unscored += arrived
        seconds = 0.0
        if self.scoring is not None and self.scoring[0].done():
            future, items = self.scoring
            values, seconds = future.result()  # raises the call's failure; its pairs stay pending
            self.scoring = None
            self._set_references(items, values)
            self.buffer += items
        if self.scoring is None and self.unscored:
            items, self.unscored = self.unscored, []
            self.scoring = (self.scorer.submit(self._score_in_thread, items, self.client.step), items)
        return seconds

    def _score_now(self, arrived: list[PreferenceItem]) -> float:
        """Score the pairs that arrived, waiting for the call, and buffer them; its seconds."""
        values, seconds = self._reference_values(arrived)
        self._set_references(arrived, values)
        self.buffer += arrived
        return seconds

    def _score_in_thread(self, items: list[PreferenceItem], step: int) -> tuple[list[list[float]], float]:
        self.client.step = step  # fault injection keys on the step that started the call
        return self._reference_values(items)

    def pending_references(self) -> list[PreferenceItem]:
        """The pairs that arrived and wait for their reference values, oldest first."""
        return (self.scoring[1] if self.scoring is not None else []) + self.unscored

    def drain(self, version: int) -> dict[str, float]:
        """Take every result that has arrived: pairs become DPO items in the buffer (with their
        reference log-probabilities, when precomputed)."""
        messages = self.inbox.drain(version, self.cfg.pool.max_version_lag)
        arrived: list[PreferenceItem] = []
        for msg in messages:
            pending = self.in_flight.pop(msg.key, None)
            outcome = msg.payload
            if outcome.error:
                self.counts["replay_errors"] += 1
            for name, value in outcome.metrics.items():
                self.outcomes[name] += value
            if pending is None:
                continue
            cost = outcome.metrics.get("replay/cost_usd", 0.0)
            for pair in outcome.pairs:
                prefix, rejected = pending.steps[pair.step_index]
                chosen = self.renderer.encode(pair.chosen) + [self.stop_token]
                item = PreferenceItem(f"{msg.key}/{pair.step_index}", prefix, chosen, rejected, pending.version)
                self.records.append(pair_record(item, self.step, pair, pending.version, cost, len(outcome.pairs),
                                                self.trains, identical=chosen == rejected))
                if chosen == rejected:
                    self.counts["pairs_identical"] += 1
                    continue
                arrived.append(item)
                self.counts["dpo_items"] += 1
        if self.scorer is not None:
            reference_s = self._score_beside_the_step(arrived)
        elif self.precomputed:
            reference_s = self._score_now(arrived) if arrived else 0.0
        else:
            reference_s = 0.0
            self.buffer += arrived
        self._prune_buffer(version)
        stats = self.inbox.stats()
        outstanding = set(self.inbox.outstanding())
        for key in [k for k in self.in_flight if k not in outstanding]:  # drained as stale or duplicate
            self.in_flight.pop(key)
        self._retry_lost(outstanding)
        acks = self.inbox.acks()
        if acks:
            self._call("ack", lambda pool: [self._actor(pool, p).ack.call_one(keys) for p, keys in acks.items()])
        return {
            **{k: float(v) for k, v in self.outcomes.items()},  # teacher calls, failures, spend
            **{f"replay/{k}": float(v) for k, v in self.counts.items()},
            "replay/stale_dropped": float(stats["stale_dropped"]),
            "replay/duplicates": float(stats["duplicates"]),
            "replay/outstanding": float(len(self.inbox.outstanding())),
            "replay/buffered_pairs": float(len(self.buffer)),
            "replay/reference_pending": float(len(self.pending_references())),
            "timing/replay_reference_s": reference_s,
        }

    def _prune_buffer(self, version: int) -> None:
        """Drop the buffered pairs whose trace is now older than `replay.pool.max_version_lag`
        (`pairs_stale`), then, oldest first, those beyond `max_pairs_per_step` x (lag + 1)
        (`pairs_overflow`): no step could train those before they grew too old."""
        lag = self.cfg.pool.max_version_lag
        fresh = [i for i in self.buffer if i.version is None or i.version >= version - lag]
        self.counts["pairs_stale"] += len(self.buffer) - len(fresh)
        over = max(0, len(fresh) - self.cfg.max_pairs_per_step * (lag + 1))
        self.counts["pairs_overflow"] += over
        self.buffer = fresh[over:]

    def _retry_lost(self, outstanding: set[str]) -> None:
        """Results overdue by `result_timeout_s` were lost: submit again, or abandon after
        `max_attempts` (both counted)."""
        c = self.cfg.pool
        now = time.monotonic()
        overdue = [k for k in outstanding if k in self.in_flight and now - self.in_flight[k].submitted_at > c.result_timeout_s]
        retry = []
        for key in overdue:
            p = self.in_flight[key]
            if p.attempts >= c.max_attempts:
                self.inbox.forget(key)
                self.in_flight.pop(key)
                self.counts["abandoned"] += 1
                log.warning("replay of %s abandoned after %d attempts without a result", key, p.attempts)
            else:
                p.attempts += 1
                p.submitted_at = now
                retry.append(key)
        if retry:
            self._call("submit", lambda pool: [
                self._actor(pool, self.in_flight[k].producer).submit.call_one(k, self.in_flight[k].trace,
                                                                            self.in_flight[k].version)
                for k in retry])
            self.counts["resubmitted_lost"] += len(retry)

    def datums(self, version: int) -> tuple[list[Datum], dict]:
        """Drain what has arrived (never waits for teachers) and the step's `dpo` Datums."""
        metrics = self.drain(version)
        return self.step_datums(), metrics

    def state_dict(self) -> dict:
        """JSON-able: dedupe state, traces still being replayed, buffered pairs, counters."""
        return {
            "inbox": self.inbox.state_dict(),
            "pending": {k: {**vars(p), "trace": dataclasses.asdict(p.trace)} for k, p in self.in_flight.items()},
            "buffer": [vars(i) for i in self.buffer + self.pending_references()],
            "counts": dict(self.counts),
            "outcomes": dict(self.outcomes),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore after a resume and hand the traces that were in flight to the (fresh) pool."""
        from meshrl.replay.trace import Trace, TraceStep

        self.inbox.load_state_dict(state["inbox"])
        self.in_flight = {}
        for key, p in state["pending"].items():
            trace = Trace(p["trace"]["episode_id"], [TraceStep(**s) for s in p["trace"]["steps"]])
            self.in_flight[key] = PendingTrace(trace, p["version"], p["producer"],
                                             [(list(a), list(b)) for a, b in p["steps"]], time.monotonic(),
                                             p["attempts"])
        self.buffer = [PreferenceItem(**i) for i in state["buffer"]]
        self.scoring, self.unscored = None, []  # a call still running scores pairs the buffer now holds
        self.counts = Counter(state["counts"])
        self.outcomes = Counter(state.get("outcomes", {}))  # checkpoints before 0.1 lacked it
        self._restore_references()
        self._after_respawn()

    def _restore_references(self) -> None:
        """Resumed pairs follow this run's `replay.reference.source`: precomputed, the pairs a
        checkpoint holds without reference values (written before they existed, under `learner`,
        or while their scoring call ran) are scored now, waiting for the call; `learner`, any
        values they hold are dropped (a step never mixes the two)."""
        if not self.precomputed:
            for item in self.buffer:
                item.reference = None
            return
        unscored = [i for i in self.buffer if i.reference is None]
        if unscored:
            self._set_references(unscored, self._reference_values(unscored)[0])

    def close(self) -> None:
        self.inbox.close()
        if self.scorer is not None:
            self.scorer.shutdown(wait=False, cancel_futures=True)


class ShardPairsTerm(PairsTerm):
    """The replay term of a learner of shards (`diloco.role: learn`): the DPO term comes from the
    teacher pairs that generation jobs with the replay term wrote into their shards, instead of a
    teacher pool of its own. Pairs arrive with the units of groups read from the shards (the pairs
    of every shard those used up); the buffer is checkpointed."""

    def __init__(self, ctx: TermContext, weight: float | None = None, params=None):
        super().__init__(ctx, weight, params)
        self.used = 0

    def receive(self, unit) -> None:
        self.buffer += unit.extras.get("pairs", [])

    def finish(self, version: int, metrics: dict) -> LossPart:
        datums = self.step_datums()  # shards carry no delivery lag: no version is needed
        self.used += len(datums) // 2
        metrics.update({"replay/dpo_items": float(self.used), "replay/buffered_pairs": float(len(self.buffer))})
        return self.part(datums)

    def state_dict(self) -> dict:
        return {"buffer": [vars(i) for i in self.buffer], "used": self.used}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = [PreferenceItem(**i) for i in state["buffer"]]
        self.used = int(state["used"])


def replay_term_class(cfg) -> type[LossTerm]:
    """A learner of shards trains on the pairs in the shards; any other job has a teacher pool."""
    return ShardPairsTerm if cfg.diloco.role == "learn" else ReplayTerm
