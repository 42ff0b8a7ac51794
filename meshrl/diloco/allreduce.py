"""ObjectStoreAllReduce: replicas with no network between them average their pseudo-gradients
through an object store, one round every H inner steps.

Layout under ``<store_url>/<run_id>/``::

    rounds/<r>/delta-<id>        the replica's delta (safetensors; fp32|bf16; zlib optional)
    rounds/<r>/commit-<id>.json  its commit marker: sha256, bytes, base hash (written after the delta)
    rounds/<r>/seal.json         the round's participants and their checksums (write-once)
    outer/<r>/manifest.json      the weights and outer momentum after round r (write-once; r = 0 is
    outer/<r>/state-<uuid>       the initial state all replicas start from)

A round: each replica uploads its delta, then its commit marker. Every replica lists the commits
until all replicas have committed, or the quorum has and `straggler_wait_s` has passed; then it
tries to create the seal with the committed set. The seal is write-once (the first writer wins).
After the seal every replica reads every sealed delta from the store (its own included) and
verifies it (sha256 and decode): a bad object is skipped by all of them alike, with a log line and
a count, and the rest is averaged in replica-id order: identical results everywhere.
Late deltas: a delta committed after the seal is ignored; its replica averages the sealed set like
the others and so continues from the same weights (its inner steps of that round are dropped).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from meshrl.config.diloco import DiLoCoConfig
from meshrl.diloco.outer import Tensors, average
from meshrl.diloco.store import CorruptObject, ObjectStore, StoreError, decode_tensors, encode_tensors, sha256

log = logging.getLogger("meshrl.diloco")
T = TypeVar("T")


class DiLoCoError(RuntimeError):
    """A round cannot complete (no quorum in time, diverged replicas, no usable outer state)."""


@dataclass
class RoundResult:
    round: int
    average: Tensors
    participants: list[int]
    included: bool
    """Whether this replica's delta is in the average (False: it was late)."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Replicas whose committed delta was rejected, with the reason."""
    upload_s: float = 0.0
    wait_s: float = 0.0
    download_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass
class OuterState:
    round: int
    params: Tensors
    momentum: Tensors
    hash: str


def _rkey(r: int) -> str:
    return f"rounds/{r:06d}"


def _okey(r: int) -> str:
    return f"outer/{r:06d}"


class ObjectStoreAllReduce:
    def __init__(self, store: ObjectStore, cfg: DiLoCoConfig):
        self.store, self.cfg, self.me = store, cfg, cfg.replica_id
        self.prefix = cfg.run_id
        self.rejected = 0  # bad objects met so far (deltas and outer states)
        self.quorum = cfg.quorum or cfg.replicas

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    # ---- one round ---------------------------------------------------------------------------
    def allreduce(self, r: int, delta: Tensors, base_hash: str) -> RoundResult:
        """Upload ``delta`` for round ``r`` (relative to weights hashing to ``base_hash``), wait for
        the seal, return the average of the sealed deltas."""
        cfg = self.cfg
        t0 = time.perf_counter()
        data = encode_tensors(delta, cfg.delta_dtype, cfg.compression)
        digest = sha256(data)
        mine = decode_tensors(data, cfg.compression)  # what the others will read, rounding included
        self.store.put(self._k(f"{_rkey(r)}/delta-{self.me:04d}"), data)
        self.store.put_json(self._k(f"{_rkey(r)}/commit-{self.me:04d}.json"),
                            {"replica": self.me, "round": r, "sha256": digest, "bytes": len(data),
                             "base_hash": base_hash, "dtype": cfg.delta_dtype, "compression": cfg.compression})
        res = RoundResult(r, {}, [], False, upload_s=time.perf_counter() - t0, bytes_up=len(data))
        seal = self._wait_for_seal(r, base_hash, res)
        return self._average_sealed(r, seal, base_hash, (digest, mine), res)

    def follow(self, r: int, base_hash: str) -> RoundResult:
        """Round ``r``'s average without taking part (wait for its seal, read the sealed deltas)."""
        res = RoundResult(r, {}, [], False)
        start = time.perf_counter()
        seal = self._poll(lambda: self._read_seal(r), f"round {r} was not sealed")
        res.wait_s = time.perf_counter() - start
        return self._average_sealed(r, seal, base_hash, None, res)

    def _poll(self, read: Callable[[], T | None], what: str) -> T:
        """``read()`` once it returns something, polling every `poll_interval_s`; DiLoCoError
        ("<what> within ...") after `round_timeout_s`."""
        start = time.perf_counter()
        while (found := read()) is None:
            if time.perf_counter() - start > self.cfg.round_timeout_s:
                raise DiLoCoError(f"{what} within {self.cfg.round_timeout_s:.0f}s (diloco.round_timeout_s)")
            time.sleep(self.cfg.poll_interval_s)
        return found

    def _average_sealed(self, r: int, seal: dict, base_hash: str, mine: tuple[str, Tensors] | None,
                        res: RoundResult) -> RoundResult:
        """Read and verify every sealed delta (``mine``: this replica's (sha256, decoded delta),
        which spares decoding its own once its stored bytes check out), then average them."""
        t1 = time.perf_counter()
        if seal.get("base_hash") != base_hash:
            raise DiLoCoError(f"round {r}: this replica's round-start weights (hash {base_hash}) differ from the "
                              f"round's ({seal.get('base_hash')}): the replicas diverged")
        deltas = {}
        for i in sorted(int(x) for x in seal["sha256"]):
            own = mine if i == self.me and mine is not None and mine[0] == seal["sha256"][str(i)] else None
            fetched = self._fetch(r, i, seal["sha256"][str(i)], res, decode=own is None)
            if fetched is not None:
                deltas[i] = own[1] if own is not None else fetched
        if not deltas:
            raise DiLoCoError(f"round {r}: none of the sealed deltas {sorted(seal['sha256'])} could be read")
        res.average = average(deltas)
        res.participants = sorted(deltas)
        res.included = self.me in deltas
        res.download_s += time.perf_counter() - t1
        if not res.included and mine is not None:
            log.warning("round %d: replica %d's delta is not in the round (late or unreadable); it continues from "
                        "the round's outer state", r, self.me)
        return res

    def _fetch(self, r: int, i: int, want: str, res: RoundResult, decode: bool = True) -> Tensors | None:
        """Replica ``i``'s delta, verified against ``want`` (without ``decode``: {} once its bytes
        check out); None (logged, counted) if bad."""
        data = self.store.get(self._k(f"{_rkey(r)}/delta-{i:04d}"))
        reason = None
        if data is None:
            reason = "delta missing"
        elif sha256(data) != want:
            reason = f"checksum mismatch ({len(data)} bytes)"
        else:
            res.bytes_down += len(data)
            try:
                return decode_tensors(data, self.cfg.compression) if decode else {}
            except CorruptObject as e:
                reason = str(e)
        self.rejected += 1
        res.skipped[i] = reason
        log.warning("round %d: skipping replica %d's delta: %s", r, i, reason)
        return None

    def _wait_for_seal(self, r: int, base_hash: str, res: RoundResult) -> dict:
        """List the round's commits until everyone (or the quorum, plus `straggler_wait_s`) has
        committed, propose the seal, and return the seal that won."""
        cfg, prefix = self.cfg, self._k(_rkey(r))
        start = time.perf_counter()
        quorum_at = None
        commits: dict[int, str] = {}
        bad: set[int] = set()
        while (seal := self._read_seal(r)) is None:
            for name in self.store.list(prefix):
                if not (name.startswith("commit-") and name.endswith(".json")):
                    continue
                i = int(name[7:11])
                if i in commits or i in bad:
                    continue
                try:
                    commit = self.store.get_json(f"{prefix}/{name}")
                    reason = None if commit.get("base_hash") == base_hash else \
                        f"its round-start weights differ (hash {commit.get('base_hash')} != {base_hash})"
                except CorruptObject as e:
                    reason = str(e)
                if reason is None:
                    commits[i] = str(commit.get("sha256"))
                else:
                    bad.add(i)
                    self.rejected += 1
                    res.skipped[i] = reason
                    log.warning("round %d: skipping replica %d's commit: %s", r, i, reason)
            now = time.perf_counter()
            if len(commits) >= self.quorum and quorum_at is None:
                quorum_at = now
            everyone = len(commits) + len(bad) >= cfg.replicas
            if quorum_at is not None and (everyone or now - quorum_at >= cfg.straggler_wait_s):
                self.store.create_json(f"{prefix}/seal.json", {"round": r, "base_hash": base_hash,
                                                               "sealed_by": self.me, "sha256": {
                                                                   str(i): commits[i] for i in sorted(commits)}})
                continue  # read the seal that won
            if now - start > cfg.round_timeout_s:
                raise DiLoCoError(f"round {r}: {len(commits)} of {cfg.replicas} replicas' deltas after "
                                  f"{cfg.round_timeout_s:.0f}s (diloco.round_timeout_s); the quorum is "
                                  f"{self.quorum}")
            time.sleep(cfg.poll_interval_s)
        res.wait_s = time.perf_counter() - start
        return seal

    def _read_seal(self, r: int) -> dict | None:
        seal = self.store.get_json(self._k(f"{_rkey(r)}/seal.json"))
        if seal is not None and not isinstance(seal.get("sha256"), dict):
            raise DiLoCoError(f"round {r}: the seal is malformed: {seal}")
        return seal

    def sealed(self, r: int) -> bool:
        return self.store.get(self._k(f"{_rkey(r)}/seal.json")) is not None

    # ---- outer states ------------------------------------------------------------------------
    def publish_outer(self, state: OuterState) -> bool:
        """Store the weights and momentum after round ``state.round`` unless another replica did
        (the state object first, then the write-once manifest); True if this call's are the ones."""
        cfg = self.cfg
        key = f"{_okey(state.round)}/state-{uuid.uuid4().hex[:12]}"
        data = encode_tensors({**{f"param.{k}": v for k, v in state.params.items()},
                               **{f"momentum.{k}": v for k, v in state.momentum.items()}}, "fp32", cfg.compression)
        self.store.put(self._k(key), data)
        won = self.store.create_json(self._k(f"{_okey(state.round)}/manifest.json"),
                                     {"round": state.round, "object": key, "sha256": sha256(data),
                                      "hash": state.hash, "compression": cfg.compression})
        if not won:
            self.store.delete(self._k(key))
        return won

    def outer_rounds(self) -> list[int]:
        return sorted(int(n) for n in self.store.list(self._k("outer")) if n.isdigit())

    def read_outer(self, r: int) -> OuterState | None:
        """The outer state after round ``r`` (verified); None if absent or bad (logged, counted)."""
        try:
            manifest = self.store.get_json(self._k(f"{_okey(r)}/manifest.json"))
            if manifest is None:
                return None
            data = self.store.get(self._k(manifest["object"]))
            if data is None or sha256(data) != manifest["sha256"]:
                raise CorruptObject("state object missing or checksum mismatch")
            tensors = decode_tensors(data, manifest.get("compression", "none"))
        except (CorruptObject, KeyError) as e:
            self.rejected += 1
            log.warning("skipping the outer state of round %d: %s", r, e)
            return None
        params = {k.removeprefix("param."): v for k, v in tensors.items() if k.startswith("param.")}
        momentum = {k.removeprefix("momentum."): v for k, v in tensors.items() if k.startswith("momentum.")}
        return OuterState(r, params, momentum, manifest["hash"])

    def latest_outer(self) -> OuterState | None:
        """The newest readable outer state."""
        for r in reversed(self.outer_rounds()):
            state = self.read_outer(r)
            if state is not None:
                return state
        return None

    def wait_round(self, r: int) -> int:
        """The run's newest round once it is at least ``r`` (an outer state of round >= r is
        committed: its manifest is written, which comes after its state object, so a round whose
        folder is listed may not be readable yet; round_timeout_s)."""

        def reached() -> int | None:
            for n in reversed(self.outer_rounds()):
                if n < r:
                    return None
                if self.store.get_json(self._k(f"{_okey(n)}/manifest.json")) is not None:
                    return n
            return None

        return self._poll(reached, f"the run did not reach round {r}")

    def wait_outer(self, r: int) -> OuterState:
        """The outer state of round ``r`` once it is there (round_timeout_s)."""
        return self._poll(lambda: self.read_outer(r), f"the outer state of round {r} did not appear")

    def prune(self, r: int) -> None:
        """Delete rounds and outer states older than the `keep_rounds` newest (up to round ``r``)."""
        oldest = r - self.cfg.keep_rounds + 1
        try:
            for name in self.store.list(self._k("rounds")):
                if name.isdigit() and int(name) < oldest:
                    self.store.delete(self._k(f"rounds/{name}"))
            for old in self.outer_rounds():
                if old < oldest:
                    self.store.delete(self._k(_okey(old)))
        except StoreError as e:  # housekeeping only: the next round tries again
            log.warning("pruning old rounds failed: %s", e)
