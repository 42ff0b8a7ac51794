"""meshrl.training.memory: freed heap memory goes back to the kernel."""

import subprocess
import sys
import textwrap

import pytest

from meshrl.training.memory import release_free_heap, reset_peak, resident_gib

# In a fresh interpreter: 256 MiB of 4 MiB blocks served from the heap (mmap threshold raised),
# touched, then all freed but the last one, which pins the heap's top so that free() alone
# cannot shrink it; prints the RSS (MiB) after the frees and after release_free_heap.
_FRAGMENT = textwrap.dedent("""
    import ctypes, ctypes.util
    from meshrl.training.memory import release_free_heap, resident_gib
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    blocks = [libc.malloc(4 << 20) for _ in range(65)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in blocks[:-1]:
        libc.free(b)
    freed = resident_gib()["rss_gib"] * 1024
    assert release_free_heap()
    print(freed, resident_gib()["rss_gib"] * 1024)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_memory_is_handed_back_to_the_kernel():
    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, timeout=60, check=True)
    freed, released = map(float, out.stdout.split())
    assert freed - released > 200, (freed, released)  # of the 256 MiB freed, the heap gave back most


def test_resident_memory_reads_the_kernels_figures():
    memory = resident_gib()
    assert 0 < memory["rss_gib"] <= memory["peak_rss_gib"]
    assert release_free_heap() is sys.platform.startswith("linux")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs")
def test_the_peak_starts_over_at_a_reset():
    """A freed 300 MiB buffer stays in the peak until reset_peak, which brings it down to the RSS."""
    buffer = b"\1" * (300 << 20)  # written: resident
    del buffer
    before = resident_gib()
    assert before["peak_rss_gib"] - before["rss_gib"] > 0.25
    assert reset_peak()
    after = resident_gib()
    assert after["peak_rss_gib"] - after["rss_gib"] < 0.05


# In a fresh interpreter: one 8 MiB block freed raises glibc's dynamic mmap threshold past 2 MiB,
# so 64 touched 2 MiB blocks come from the heap; all but the last are freed. Prints the RSS (MiB)
# the frees gave back; with argv[1] == "fixed" the threshold is first fixed at 1 MiB.
_BIG_BLOCKS = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    from meshrl.training.memory import resident_gib, set_mmap_threshold
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(8 << 20))
    if sys.argv[1] == "fixed":
        assert set_mmap_threshold(1 << 20)
    blocks = [libc.malloc(2 << 20) for _ in range(64)]
    for b in blocks:
        ctypes.memset(b, 1, 2 << 20)
    held = resident_gib()["rss_gib"] * 1024
    for b in blocks[:-1]:
        libc.free(b)
    print(held - resident_gib()["rss_gib"] * 1024)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_fixed_mmap_threshold_hands_big_blocks_back_when_freed():
    def given_back(mode):
        out = subprocess.run([sys.executable, "-c", _BIG_BLOCKS, mode], capture_output=True, text=True,
                             timeout=60, check=True)
        return float(out.stdout)

    assert given_back("fixed") > 100  # of 126 MiB freed
    assert given_back("dynamic") < 50  # glibc's own threshold keeps them in the heap
