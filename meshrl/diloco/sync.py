"""DiLoCoSync: one replica's side of DiLoCo, over the live parameters of any torch model.

``join`` aligns the replica with the run (the newest outer state in the store, or this replica's
weights as the run's initial state if there is none); ``sync`` ends a round: pseudo-gradient,
object-store all-reduce, the outer Nesterov step on the round-start weights, written back into the
parameters, so every replica starts the next round from identical weights (checked by hash: the
seal records the round-start hash and a replica whose hash differs is refused).
"""

from __future__ import annotations

import logging
import time

import torch

from meshrl.config.diloco import DiLoCoConfig
from meshrl.diloco.allreduce import DiLoCoError, ObjectStoreAllReduce, OuterState
from meshrl.diloco.outer import OuterOptimizer, Tensors, pseudo_gradient, weights_hash
from meshrl.diloco.store import ObjectStore

log = logging.getLogger("meshrl.diloco")


class DiLoCoSync:
    def __init__(self, cfg: DiLoCoConfig, store: ObjectStore | None = None, writer: bool = True):
        """``writer`` False: read the rounds without uploading (a data-parallel rank that is not
        its replica's first: it applies the same outer steps from the same seals)."""
        self.cfg = cfg
        self.store = store or ObjectStore(cfg.store_url, cfg.storage_options, cfg.op_timeout_s)
        self.allreduce = ObjectStoreAllReduce(self.store, cfg)
        self.outer = OuterOptimizer(cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
        self.writer = writer
        self.round = 0
        self.start_params: Tensors = {}
        self.base_hash = ""

    def _adopt(self, state: OuterState, params: dict[str, torch.nn.Parameter]) -> None:
        missing = set(params) ^ set(state.params)
        if missing:
            raise DiLoCoError(f"the store's outer state of round {state.round} does not match this model's "
                              f"parameters (e.g. {sorted(missing)[:2]}): another run under run_id "
                              f"{self.cfg.run_id!r}?")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state.params[name])
        self.start_params = {k: v.clone() for k, v in state.params.items()}
        self.outer.load_state_dict(state.momentum)
        self.round = state.round
        self.base_hash = weights_hash(self.start_params)
        if self.base_hash != state.hash:
            raise DiLoCoError(f"the outer state of round {state.round} hashes to {self.base_hash}, its manifest "
                              f"says {state.hash}")

    def join(self, params: dict[str, torch.nn.Parameter]) -> dict:
        """Start from the run's newest outer state (publishing these weights as the initial state
        when the run is new); returns ``{round, hash, rejoined}``."""
        state = self.allreduce.latest_outer()
        rejoined = state is not None
        if state is None:
            initial = {k: p.detach().float().clone() for k, p in params.items()}
            if self.writer:
                self.allreduce.publish_outer(OuterState(0, initial, {}, weights_hash(initial)))
            state = self.allreduce.wait_outer(0)  # whoever won the write-once initial state
        self._adopt(state, params)
        if rejoined:
            log.info("replica %d joined the run at round %d", self.cfg.replica_id, self.round)
        return {"round": self.round, "hash": self.base_hash, "rejoined": rejoined}

    def sync(self, params: dict[str, torch.nn.Parameter]) -> dict:
        """End the current round: returns its report (participants, split times, bytes, new hash)."""
        t0 = time.perf_counter()
        r = self.round + 1
        newest = self.allreduce.outer_rounds()
        if newest and newest[-1] >= r:  # the others finished this round (and maybe more) without us
            state = self.allreduce.latest_outer()
            if state is not None and state.round >= r:
                self._adopt(state, params)
                log.warning("replica %d was behind (round %d); caught up to round %d", self.cfg.replica_id, r,
                            state.round)
                return {"round": self.round, "caught_up": 1, "hash": self.base_hash, "participants": [],
                        "round_s": time.perf_counter() - t0}
        delta = pseudo_gradient(self.start_params, {k: p for k, p in params.items()})
        # sealed before this call: a late replica, or one restarted after its delta was sealed
        # (uploading again would replace the sealed delta, and the others' average would differ)
        sealed = self.writer and self.allreduce.sealed(r)
        if sealed:
            log.warning("replica %d: round %d is already sealed; following it without uploading",
                        self.cfg.replica_id, r)
        if self.writer and not sealed:
            res = self.allreduce.allreduce(r, delta, self.base_hash)
        else:
            res = self.allreduce.follow(r, self.base_hash)
        t1 = time.perf_counter()
        new = self.outer.step(self.start_params, res.average)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(new[name])
        self.start_params, self.round = new, r
        self.base_hash = weights_hash(new)
        outer_s = time.perf_counter() - t1
        if self.writer and self.cfg.replica_id == min(res.participants):  # the round's leader
            t2 = time.perf_counter()
            self.allreduce.publish_outer(OuterState(r, new, self.outer.state_dict(), self.base_hash))
            self.allreduce.prune(r)
            res.upload_s += time.perf_counter() - t2
        return {"round": r, "participants": res.participants, "included": int(res.included),
                "skipped": len(res.skipped), "upload_s": res.upload_s, "wait_s": res.wait_s,
                "download_s": res.download_s, "outer_s": outer_s, "bytes_up": res.bytes_up,
                "bytes_down": res.bytes_down, "hash": self.base_hash, "round_s": time.perf_counter() - t0,
                "rejected_total": self.allreduce.rejected}
