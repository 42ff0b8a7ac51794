"""The rendezvous of a process group spanning a proc mesh: a free TCP port on the mesh's first
process, reachable by the others (127.0.0.1 when every process shares one machine, the first
process's address otherwise). Resolved when the actors are spawned, so a replaced mesh (possibly
on other hosts) gets a fresh one."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from monarch.actor import Actor, endpoint

from meshrl.transport.same_host import machine_identity


@dataclass(frozen=True)
class Rendezvous:
    """Placeholder among an actor's spawn arguments for ``tcp://host:port`` of its group."""


def _free_port(bind: str) -> int:
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


class _Whereabouts(Actor):
    """Answers where its process runs (and, on request, a port free there)."""

    @endpoint
    def where(self, want_port: bool) -> dict:
        machine = machine_identity()  # the kernel, not a simulated host on it
        address = socket.gethostbyname(socket.gethostname())
        return {"machine": machine, "address": address, "port": _free_port("0.0.0.0") if want_port else 0}


def rendezvous_address(procs, timeout_s: float) -> str:
    """``tcp://host:port`` for a process group over every process of the proc mesh ``procs``."""
    probe = procs.spawn("rendezvous-probe", _Whereabouts)
    try:
        first = probe.slice(**{dim: 0 for dim in probe.extent}).where.call_one(True).get(timeout=timeout_s)
        everyone = list(probe.where.call(False).get(timeout=timeout_s).values())
    finally:
        probe.stop()
    same_machine = all(w["machine"] == first["machine"] for w in everyone)
    return f"tcp://{'127.0.0.1' if same_machine else first['address']}:{first['port']}"


def resolve_rendezvous(procs, size: int, args: tuple, timeout_s: float) -> tuple:
    """``args`` with each `Rendezvous` replaced by the address of a fresh one on ``procs`` (of
    ``size`` processes; a single process needs none: ``""``)."""
    if not any(isinstance(a, Rendezvous) for a in args):
        return args
    address = rendezvous_address(procs, timeout_s) if size > 1 else ""
    return tuple(address if isinstance(a, Rendezvous) else a for a in args)
