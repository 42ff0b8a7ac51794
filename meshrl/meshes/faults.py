"""Fault injection for real runs: kill an actor's process at a given step or mid-call, or make an
endpoint hang or raise once. Driven by the `faults.inject` config section."""

from __future__ import annotations

import logging
import threading

from meshrl.config.faults import FaultInjection

log = logging.getLogger(__name__)


class FaultInjector:
    """Fires each configured fault once, at its step and phase."""

    def __init__(self, injections: list[FaultInjection], meshes):
        self.meshes = meshes
        self.pending = list(injections)
        self.fired: list[dict] = []
        self._lock = threading.Lock()  # the producer thread and the learner side both call in

    def before_call(self, step: int, mesh: str, phase: str) -> None:
        """Called when a step begins (phase `step_start`: its rollout starts) and before each
        remote call (with the call's mesh and phase), from whichever thread works on ``step``."""
        with self._lock:
            for fault in list(self.pending):
                if fault.at_step != step:
                    continue
                if phase == "step_start" and fault.action in ("delay", "raise", "drop"):
                    self._arm_endpoint(fault)
                elif fault.action == "kill" and fault.during == phase:
                    self._kill(fault, delay_s=0.0 if phase == "step_start" else fault.seconds)
                else:
                    continue
                self.pending.remove(fault)

    def _arm_endpoint(self, fault: FaultInjection) -> None:
        actor = self.meshes[fault.mesh].slice(procs=fault.rank)
        actor.inject_fault.call_one(fault.endpoint, fault.action, fault.seconds).get(timeout=30)
        self._record(fault)

    def _kill(self, fault: FaultInjection, delay_s: float) -> None:
        def fire():
            pid = self.meshes.kill(fault.mesh, fault.rank)
            log.warning("fault injection: killed %s[%d] (pid %d) at step %d during %s",
                        fault.mesh, fault.rank, pid, fault.at_step, fault.during)

        self._record(fault)
        if delay_s <= 0:
            fire()
        else:
            timer = threading.Timer(delay_s, fire)
            timer.daemon = True
            timer.start()

    def _record(self, fault: FaultInjection) -> None:
        self.fired.append(fault.model_dump())
