"""How a sandboxed execution failed, as an error kind (``meshrl.envs.base.ERROR_KINDS``): from the
uncaught-exception lines in its stderr (``last_exceptions``, ``exception_kind``) and from how it
ended -- exit code, signal, timeout, output limit (``classify``)."""

from __future__ import annotations

import errno
import re
import signal


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_EXC_NAME = re.compile(r"(Error|Exception|Exit|Interrupt|Warning|gaierror|herror|timeout)$")

_BY_EXCEPTION = {
    "SyntaxError": "syntax_error",
    "IndentationError": "syntax_error",
    "TabError": "syntax_error",
    "MemoryError": "memory_error",
    "ModuleNotFoundError": "import_error",
    "ImportError": "import_error",
    "PermissionError": "permission_denied",
    "FileNotFoundError": "file_not_found",
    "NotADirectoryError": "file_not_found",
    "IsADirectoryError": "file_not_found",
    "ConnectionRefusedError": "network_error",
    "ConnectionResetError": "network_error",
    "ConnectionAbortedError": "network_error",
    "ConnectionError": "network_error",
    "gaierror": "network_error",
    "herror": "network_error",
    "socket.gaierror": "network_error",
    "socket.herror": "network_error",
    "BlockingIOError": "resource_limit",
    "ChildProcessError": "resource_limit",
}

_BY_ERRNO = {
    errno.EROFS: "permission_denied",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.ENOENT: "file_not_found",
    errno.EAGAIN: "resource_limit",
    errno.EMFILE: "resource_limit",
    errno.ENFILE: "resource_limit",
    errno.EFBIG: "resource_limit",
    errno.ENOSPC: "resource_limit",
    errno.EDQUOT: "resource_limit",
    errno.ENOMEM: "memory_error",
    errno.ENETUNREACH: "network_error",
    errno.EHOSTUNREACH: "network_error",
    errno.ECONNREFUSED: "network_error",
    errno.EADDRNOTAVAIL: "network_error",
    errno.ENETDOWN: "network_error",
}
_ERRNO_RE = re.compile(r"\[Errno (\d+)\]")


def exception_kind(exc_type: str, message: str = "") -> str:
    """Map a Python exception (type name and message) to an error kind."""
    name = exc_type.rsplit(".", 1)[-1] if exc_type not in _BY_EXCEPTION else exc_type
    kind = _BY_EXCEPTION.get(exc_type) or _BY_EXCEPTION.get(name)
    if kind:
        return kind
    m = _ERRNO_RE.search(message or "")
    if m and name in ("OSError", "IOError", "error", "TimeoutError"):
        return _BY_ERRNO.get(int(m.group(1)), "runtime_error")
    if name == "TimeoutError" and not m:
        return "timeout"
    if name in ("timeout",):
        return "network_error"
    return "runtime_error"


def last_exceptions(stderr: str) -> list[tuple[str, str]]:
    """(type, message) of every uncaught-exception line in ``stderr``, in order."""
    found: list[tuple[str, str]] = []
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if not line or line[0].isspace():
            continue
        m = _EXC_LINE.match(line)
        if not m or not _EXC_NAME.search(m.group(1)):
            continue
        # an exception line ends a traceback: it follows an indented frame/caret line
        # or a 'Traceback' header (SyntaxError reports have no header)
        prev = lines[i - 1] if i > 0 else ""
        if i == 0 or prev.startswith((" ", "\t", "Traceback")):
            found.append((m.group(1), m.group(2) or ""))
    return found


def classify(
    *,
    exit_code: int | None,
    killed_signal: int | None,
    timed_out: bool,
    output_limited: bool,
    stderr: str,
    exec_failed: bool = False,
) -> str | None:
    """The error kind of an execution from how it ended and what it printed to stderr."""
    excs = last_exceptions(stderr)
    kinds = [exception_kind(t, m) for t, m in excs]
    if exec_failed:
        return "tool_not_found"
    if "resource_limit" in kinds and (timed_out or output_limited or exit_code not in (0, None)):
        return "resource_limit"  # fork bombs: EAGAIN tracebacks, then a timeout or output flood
    if output_limited:
        return "output_limit"
    if timed_out or killed_signal in (signal.SIGXCPU,):
        return "timeout"
    if killed_signal == signal.SIGXFSZ:
        return "resource_limit"
    if killed_signal is not None:
        if "memory_error" in kinds:
            return "memory_error"
        return "crash"
    if exit_code == 0:
        return None
    if kinds:
        if "memory_error" in kinds:
            return "memory_error"
        return kinds[-1]
    return "runtime_error"
