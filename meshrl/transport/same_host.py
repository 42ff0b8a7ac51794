"""Same-host weight transports: a reader on the publisher's machine copies the published arena
straight out of the publisher's memory instead of through Monarch's RDMA layer (whose TCP fallback
on a CPU host moves ~1 GB/s, against ~10 GB/s for a memcpy).

* **CPU arenas** live in named shared memory: a file ``/dev/shm/meshrl-arena.<ns>.<pid>.<start>.<token>``
  (``ns`` the publisher's pid namespace, ``pid`` and ``start`` its process id and start time) that
  the publisher maps and packs into. A reader maps the same file, caching the mapping per segment
  (the publisher's pool reuses arenas, so the same few segments come back) until the publisher
  unlinks it, and memcpys into its own arena.
* **CUDA arenas** are exported once with CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``);
  a reader opens each handle once and keeps it open (`CudaHandles`: the publisher's pool reuses its
  arenas, so the same few handles come back), copies device to device without waiting, and
  synchronises once when a fill is complete. Opening a handle and synchronising are fixed costs that
  dominated a pull when paid per copy.

The weight store (``weight_store.py``) decides when to use these (same host identity, transport
config) and keeps RDMA buffers registered over the same memory for readers elsewhere.

Segment lifetime: ``SharedArena.close()`` unlinks its file (also done when the object is collected
and at interpreter exit). A SIGKILLed publisher cannot do that, so every new segment first removes
the segments whose creating process is gone (``remove_stale_segments``); the start time in the name
tells the owner from a later process that reuses its pid. Readers refuse segments of a dead owner.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import socket
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from meshrl.transport.arena import ArenaLayout, allocate_arena, views
from meshrl.transport.shards import Move, apply_move

SHM_DIR = "/dev/shm"
PREFIX = "meshrl-arena"

logger = logging.getLogger(__name__)


class SameHostUnavailable(RuntimeError):
    """The publisher's arena cannot be reached from this process (another host, no segment offered,
    the segment cannot be opened); nothing was copied, so RDMA may still be used."""


class OwnerGone(RuntimeError):
    """The process that published the segment no longer runs: its version is not served."""


SIMULATED_HOSTS_ENV = "MESHRL_SIMULATED_HOSTS"
"""Set (to 1) by launchers whose hosts are worker processes on one machine: each worker is then a
host of its own, so nothing is shared between them through this machine's memory."""


@functools.cache
def machine_identity() -> str:
    """This machine as ``hostname/boot id``: equal on two processes only if they share one running
    kernel (a reused hostname on another machine, or after a reboot, does not match)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


@functools.cache
def host_identity() -> str:
    """The host this process runs on: `machine_identity()`, followed by ``@worker`` when the
    launcher simulates hosts as worker processes of one machine (Monarch names each process
    ``<proc> @ <host worker>`` in HYPERACTOR_PROCESS_NAME)."""
    worker = os.environ.get("HYPERACTOR_PROCESS_NAME", "").rpartition(" @ ")[2]
    if os.environ.get(SIMULATED_HOSTS_ENV) == "1" and worker:
        return f"{machine_identity()}@{worker}"
    return machine_identity()


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` (clock ticks since boot), or None if no such process runs (a zombie,
    dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # from field 3 on; the command name before ")" may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]  # state (field 3), starttime (field 22)


def _owner_alive(name: str) -> bool | None:
    """Whether the process that created segment ``name`` still runs; None when this process cannot
    tell (not a segment name, or created in another pid namespace)."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[1] != _pid_namespace() or not parts[2].isdigit():
        return None
    return _process_start(int(parts[2])) == parts[3]


def remove_stale_segments() -> list[str]:
    """Unlink every segment whose creating process is gone; returns their names."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for name in names:
        if name.startswith(PREFIX + ".") and _owner_alive(name) is False:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:  # another publisher removed it first
                continue
            removed.append(name)
    if removed:
        logger.info("removed %d shared-memory segments of dead publishers: %s", len(removed), ", ".join(removed))
    return removed


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over a shared read-write mapping of the file (the tensor keeps it mapped)."""
    return torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)


def _unlink(path: str, owner_pid: int) -> None:
    """Unlink ``path`` from the process that created it (not from a forked child exiting)."""
    if os.getpid() != owner_pid:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class SegmentRef:
    """A CPU arena in shared memory: the file name under ``/dev/shm`` and its size in bytes."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class CudaIpcRef:
    """A CUDA arena exported with ``reduce_tensor``: ``rebuild(*args)`` in another process on the
    same host maps the same device memory."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple


LocalRef = SegmentRef | CudaIpcRef


class SharedArena:
    """A publisher's arena: ``memory`` (1-D uint8, ``nbytes`` long) and ``ref``, how readers on this
    host reach it (None when not shared: ``share`` False, or /dev/shm unusable, which is logged).
    ``close()`` unlinks the segment; mappings already open stay valid until their readers drop them."""

    def __init__(self, nbytes: int, device: str, share: bool) -> None:
        self.ref: LocalRef | None = None
        self._finalizer: weakref.finalize | None = None
        if share and torch.device(device).type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.memory = allocate_arena(nbytes, device)
            self.ref = CudaIpcRef(*reduce_tensor(self.memory))
            return
        if share:
            try:
                self.memory, self.ref = self._create_segment(nbytes)
                return
            except OSError as e:
                logger.warning("no shared-memory arena (%s); same-host readers will use RDMA", e)
        self.memory = allocate_arena(nbytes, device)

    def _create_segment(self, nbytes: int) -> tuple[torch.Tensor, SegmentRef]:
        remove_stale_segments()
        pid = os.getpid()
        start = _process_start(pid)
        if start is None:
            raise OSError(f"/proc/{pid}/stat is unreadable: a segment could not be told stale")
        name = f"{PREFIX}.{_pid_namespace()}.{pid}.{start}.{uuid.uuid4().hex[:16]}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._finalizer = weakref.finalize(self, _unlink, path, pid)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # a full /dev/shm fails here, not as SIGBUS on a later write
            return _map(fd, nbytes), SegmentRef(name, nbytes)
        except OSError:
            self.close()
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unlink the segment (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()


class CudaHandles:
    """The CUDA IPC arenas this process has opened, kept open for the next pulls: at most
    ``capacity`` (the publisher's arena pool), the least recently used closed first (its tensor
    released, so CUDA closes the handle and the publisher may free the memory). Copies out of them
    are queued without waiting; `synchronize` waits once for every device copied on."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._open: OrderedDict[CudaIpcRef, torch.Tensor] = OrderedDict()
        self._pending: set[torch.device] = set()
        self.opened = 0
        """Handles opened so far (a pull from an arena already open opens none)."""

    def source(self, ref: CudaIpcRef) -> torch.Tensor:
        """The arena behind ``ref``, opened at its first use; raises ``SameHostUnavailable``."""
        src = self._open.pop(ref, None)
        if src is None:
            try:
                src = ref.rebuild(*ref.args)
            except RuntimeError as e:
                raise SameHostUnavailable(f"CUDA IPC handle could not be opened: {e}") from e
            self.opened += 1
        self._open[ref] = src
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
        self._pending.add(src.device)
        return src

    def synchronize(self) -> None:
        """Wait for the copies queued since the last call (one wait per device)."""
        for device in self._pending:
            torch.cuda.synchronize(device)
        self._pending.clear()


class SameHostReader:
    """Copies arenas published on this host into a reader's own arena. Segment mappings are cached
    by name until ``drop_unlinked`` finds their file unlinked (the weight puller calls it at every
    pull), so the pages of an arena its publisher dropped are freed by the reader's next pull; CUDA
    arenas stay open in `CudaHandles` (``cuda_handles`` of them), and `synchronize` ends a fill."""

    def __init__(self, cuda_handles: int = 3) -> None:
        self._segments: dict[str, torch.Tensor] = {}
        self.cuda = CudaHandles(cuda_handles)

    def synchronize(self) -> None:
        """Wait for the CUDA copies made since the last call (before the publisher may reuse the arena)."""
        self.cuda.synchronize()

    def drop_unlinked(self) -> None:
        """Unmap cached segments whose file the publisher has unlinked, freeing their pages."""
        self._segments = {n: t for n, t in self._segments.items() if os.path.exists(os.path.join(SHM_DIR, n))}

    def copy_moves(self, ref: LocalRef, dst: torch.Tensor, moves: Iterable[Move]) -> None:
        """Apply ``moves`` (their ``src`` offsets in the arena behind ``ref``) into ``dst``. Raises
        ``SameHostUnavailable`` when the arena cannot be opened and ``OwnerGone`` when its publisher
        died (both before any byte is written). CUDA copies are only queued: `synchronize` waits."""
        src = self.cuda.source(ref) if isinstance(ref, CudaIpcRef) else self._segment(ref)
        for m in moves:
            apply_move(src, dst, m)

    def _segment(self, ref: SegmentRef) -> torch.Tensor:
        if _owner_alive(ref.name) is False:
            raise OwnerGone(f"the publisher process of shared-memory segment {ref.name} is gone")
        mapped = self._segments.get(ref.name)
        if mapped is None:
            try:
                fd = os.open(os.path.join(SHM_DIR, ref.name), os.O_RDWR)
            except OSError as e:
                raise SameHostUnavailable(f"shared-memory segment {ref.name} could not be opened: {e}") from e
            try:
                size = os.fstat(fd).st_size
                if size < ref.nbytes:
                    raise SameHostUnavailable(f"shared-memory segment {ref.name} holds {size} bytes, not {ref.nbytes}")
                mapped = self._segments[ref.name] = _map(fd, ref.nbytes)
            finally:
                os.close(fd)
        return mapped


@dataclass(frozen=True)
class HostFill:
    """One bucket of a version for another process on the publishers' host to fill itself (a
    tensor-parallel engine's worker): the bucket's ``layout`` and size, and per publishing part its
    arena and the moves out of it. No tensor bytes travel with it."""

    layout: ArenaLayout
    nbytes: int
    parts: tuple[tuple[LocalRef, tuple[Move, ...]], ...]
    transport: str
    """"shm" or "cuda_ipc" (every part's)."""


class HostFiller:
    """The filling process's side of :class:`HostFill`: one bucket buffer, reused, filled straight
    out of the publishers' arenas."""

    def __init__(self) -> None:
        self.reader = SameHostReader()
        self.buffer: torch.Tensor | None = None

    def fill(self, plan: HostFill, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The bucket's tensors: views of the buffer, valid until the next fill. Raises as
        :meth:`SameHostReader.copy_moves` does."""
        self.reader.drop_unlinked()
        if self.buffer is None or self.buffer.numel() < plan.nbytes or self.buffer.device != torch.device(device):
            self.buffer = allocate_arena(plan.nbytes, device)
        for ref, part_moves in plan.parts:
            self.reader.copy_moves(ref, self.buffer, part_moves)
        self.reader.synchronize()
        return views(self.buffer, plan.layout)


def local_transport(mode: str, publisher_host: str, ref: LocalRef | None) -> str | None:
    """The same-host transport a pull under config ``mode`` (auto, rdma, shm) uses for a version
    published on ``publisher_host`` with ``ref``: ``"shm"`` or ``"cuda_ipc"``, or None for RDMA.
    Raises ``SameHostUnavailable`` under ``shm`` when the publisher is elsewhere or shares nothing
    this process can open (a GPU arena, in a process that sees no GPU)."""
    if mode == "rdma":
        return None
    if publisher_host != host_identity():
        if mode == "shm":
            raise SameHostUnavailable(
                f"transport 'shm' needs the publisher on this host ({host_identity()}), it is on {publisher_host}"
            )
        return None
    if ref is None:
        if mode == "shm":
            raise SameHostUnavailable(
                "transport 'shm' but the publisher shares no arena (its transport is 'rdma', or /dev/shm was unusable)"
            )
        return None
    if isinstance(ref, CudaIpcRef) and not torch.cuda.is_available():
        if mode == "shm":
            raise SameHostUnavailable("transport 'shm' but the publisher's arena is in GPU memory and this process "
                                      "sees no GPU (CUDA IPC needs one)")
        return None
    return "cuda_ipc" if isinstance(ref, CudaIpcRef) else "shm"

