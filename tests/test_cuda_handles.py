"""CUDA IPC handles stay open across pulls (one open per arena), the least recently used closes
past the publisher's pool size, and a fill waits once. The handle is a stand-in whose `rebuild`
returns a CPU tensor and counts its calls: what is tested is the reader's cache around it."""

import gc
import weakref

import torch

from meshrl.transport.same_host import CudaIpcRef, SameHostReader
from meshrl.transport.shards import Move


class Arenas:
    """Published arenas 0..n-1 as IPC refs whose `rebuild` opens (here: allocates) the arena."""

    def __init__(self, n: int):
        self.opens: list[int] = []
        self.refs = [CudaIpcRef(self.rebuild, (i,)) for i in range(n)]
        self.live: list[weakref.ref] = []

    def rebuild(self, i: int) -> torch.Tensor:
        self.opens.append(i)
        arena = torch.full((16,), i, dtype=torch.uint8)
        self.live.append(weakref.ref(arena))
        return arena


def pull(reader: SameHostReader, ref: CudaIpcRef) -> torch.Tensor:
    dst = torch.zeros(16, dtype=torch.uint8)
    reader.copy_moves(ref, dst, [Move(0, 0, 0, 16)])
    reader.synchronize()
    return dst


def test_each_arena_is_opened_once_while_the_pool_cycles(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    arenas, reader = Arenas(3), SameHostReader(cuda_handles=3)
    for round_ in range(4):
        for i, ref in enumerate(arenas.refs):
            assert pull(reader, ref).tolist() == [i] * 16
    assert arenas.opens == [0, 1, 2]
    assert reader.cuda.opened == 3
    assert len(waits) == 12  # one per fill, not one per copy or per open


def test_past_the_pool_size_the_least_recently_used_handle_is_closed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    arenas, reader = Arenas(4), SameHostReader(cuda_handles=2)
    pull(reader, arenas.refs[0])
    pull(reader, arenas.refs[1])
    pull(reader, arenas.refs[0])  # 0 is now the most recently used
    pull(reader, arenas.refs[2])  # closes 1
    gc.collect()
    assert [r() is not None for r in arenas.live] == [True, False, True]
    pull(reader, arenas.refs[1])  # reopened; closes 0
    gc.collect()
    assert arenas.opens == [0, 1, 2, 1]
    assert [r() is not None for r in arenas.live] == [False, False, True, True]


def test_a_fill_with_several_copies_waits_once(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    arenas, reader = Arenas(2), SameHostReader(cuda_handles=2)
    dst = torch.zeros(32, dtype=torch.uint8)
    reader.copy_moves(arenas.refs[0], dst, [Move(0, 0, 0, 8), Move(0, 8, 8, 8)])
    reader.copy_moves(arenas.refs[1], dst, [Move(0, 0, 16, 16)])
    assert waits == []  # the copies are queued, not waited for
    reader.synchronize()
    assert waits == [torch.device("cpu")] and dst.tolist() == [0] * 16 + [1] * 16
    reader.synchronize()
    assert len(waits) == 1  # nothing queued since
