"""A line-based two-way pipe between the host and one sandboxed program (``Sandbox.converse``).

The host sends request lines on one pipe and reads the program's reply lines from another; the
program finds the two descriptors in ``$MESHRL_CALL_FD`` (read) and ``$MESHRL_REPLY_FD`` (write).
The host side is used from two threads: the conversation (``send``/``recv``, e.g. a grader) and the
sandbox's I/O loop, which feeds the reply bytes in (``feed``/``eof``) and kills the program when
the conversation asks it to (``stop``) or ended more than a grace period ago (``finish``).
Every wait has a deadline: a silent or dead program raises ``ChannelClosed``/``ChannelTimeout``.
"""

from __future__ import annotations

import os
import queue
import select
import threading
import time

#: how long the program may take to exit by itself once the conversation is over
EXIT_GRACE_S = 1.0


class ChannelClosed(Exception):
    """The program's end is gone (it exited, was killed, or closed its descriptors)."""


class ChannelTimeout(Exception):
    """The program did not answer (or read) within the time given."""


class Channel:
    """Host side of the pipes; the program's ends (``call_r``, ``reply_w``) are passed to it and
    closed here once it started (``child_started``)."""

    def __init__(self, max_line_bytes: int = 16 << 20):
        self.call_r, self.call_w = os.pipe()
        self.reply_r, self.reply_w = os.pipe()
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.call_w, self.reply_r, self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.max_line_bytes = max_line_bytes
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._partial = bytearray()
        self._closed = False
        self.kill_requested = False
        self.finished_at: float | None = None
        self.overflowed = False
        """A reply line passed ``max_line_bytes`` (the program is killed)."""
        self.extra_lines = 0
        """Reply lines left unread when the conversation ended (nobody asked for them)."""
        self._started_pid: int | None = None
        self._threads: list[str] = []  # schedstat files of the I/O loop's and the conversation's threads
        self.program_pid: int | None = None
        """The program's own process, once ``locate_program`` found it."""

    # ---------------------------------------------------------------- the program's side
    def child_fds(self) -> tuple[int, int]:
        return self.call_r, self.reply_w

    def child_env(self) -> dict[str, str]:
        return {"MESHRL_CALL_FD": str(self.call_r), "MESHRL_REPLY_FD": str(self.reply_w)}

    def child_started(self, pid: int) -> None:
        """The program's process ``pid`` (or the isolation layer's, above it) started; the calling
        thread is the I/O loop's."""
        for fd in (self.call_r, self.reply_w):
            os.close(fd)
        self.call_r = self.reply_w = -1
        self._started_pid = pid
        self._threads = [f"/proc/self/task/{threading.get_native_id()}/schedstat"]

    def locate_program(self) -> None:
        """Find the program's own process: the end of the chain of only children below the
        started one (bubblewrap puts two of its own above the program); the calling thread is the
        conversation's. Call it once the program answered and before it runs anything untrusted,
        so nothing it forks can pass for it."""
        pid = self._started_pid
        while pid is not None:
            children = _children(pid)
            if len(children) != 1:
                break
            pid = children[0]
        self.program_pid = pid
        self._threads = self._threads[:1] + [f"/proc/self/task/{threading.get_native_id()}/schedstat"]

    def times_s(self) -> tuple[float, float]:
        """By the kernel's count (``schedstat``, each thread's file read once): the seconds the
        conversation's three threads (the program's main thread, the I/O loop's and the
        conversation's, once ``locate_program`` ran) have spent ready to run but waiting for a
        CPU, i.e. time the host's load took from the conversation; and the seconds the program's
        main thread has run on a CPU (0.0 when not located). A thread that is gone, or a kernel
        that does not count, adds 0.0."""
        ours = [_schedstat(path) for path in self._threads]
        ran, waited = _schedstat(f"/proc/{self.program_pid}/schedstat") if self.program_pid is not None else (0.0, 0.0)
        return waited + sum(w for _, w in ours), ran

    # ---------------------------------------------------------------- the conversation's side
    def send(self, line: bytes, timeout_s: float) -> None:
        """Write one request line; raises when the program stopped reading."""
        data = memoryview(line.rstrip(b"\n") + b"\n")
        deadline = time.monotonic() + timeout_s
        while data:
            if self.call_w < 0:
                raise ChannelClosed("the program's request pipe is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout("the program stopped reading its requests")
            _, writable, _ = select.select([], [self.call_w], [], left)
            if not writable:
                continue
            try:
                data = data[os.write(self.call_w, data):]
            except BlockingIOError:
                continue
            except OSError as e:  # EPIPE: nobody reads any more
                raise ChannelClosed(f"the program's request pipe is closed ({e.strerror})") from None

    def recv(self, timeout_s: float) -> bytes:
        """The next reply line (without its newline)."""
        try:
            line = self._lines.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise ChannelTimeout(f"no reply within {timeout_s:.1f} s") from None
        if line is None:
            self._lines.put(None)  # every later recv sees the end too
            raise ChannelClosed("the program ended")
        return line

    def stop(self) -> None:
        """Kill the program now (it hangs, or misbehaved)."""
        self.kill_requested = True
        self._wake()

    def finish(self) -> None:
        """The conversation is over: close the request pipe (the program should exit on its end of
        file) and count what it sent unasked; it is killed if still running after the grace."""
        self.finished_at = time.monotonic()
        if self.call_w >= 0:
            os.close(self.call_w)
            self.call_w = -1
        while True:
            try:
                if self._lines.get_nowait() is not None:
                    self.extra_lines += 1
            except queue.Empty:
                break
        if self._partial:
            self.extra_lines += 1
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    # ---------------------------------------------------------------- the I/O loop's side
    def feed(self, data: bytes) -> bool:
        """Bytes read from the reply pipe; False when a line grew past the cap."""
        self._partial += data
        while True:
            nl = self._partial.find(b"\n")
            if nl < 0:
                break
            if self.finished_at is None:
                self._lines.put(bytes(self._partial[:nl]))
            else:
                self.extra_lines += 1
            del self._partial[: nl + 1]
        if len(self._partial) > self.max_line_bytes:
            self.overflowed = True
            self._partial.clear()
            return False
        return True

    def eof(self) -> None:
        self._lines.put(None)

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except OSError:
            pass

    def should_kill(self, now: float) -> bool:
        return self.kill_requested or (self.finished_at is not None and now - self.finished_at > EXIT_GRACE_S)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self.call_r, self.call_w, self.reply_r, self.reply_w, self.wake_r, self.wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _children(pid: int) -> list[int]:
    """The child processes of ``pid``'s threads (empty when it is gone)."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        return []
    return found


def _schedstat(path: str) -> tuple[float, float]:
    """A thread's (seconds on a CPU, seconds waiting for one); zeros when it cannot be read."""
    try:
        with open(path) as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0
