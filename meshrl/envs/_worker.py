"""The candidate's side of grading: runs *inside* the sandbox (stdlib only; shipped there as a file).

It knows nothing of the tests. Once started (before any code of the candidate's runs) it says
``{"ok": true}`` on its reply pipe (``$MESHRL_REPLY_FD``); then it receives one JSON object per
line on its request pipe (``$MESHRL_CALL_FD``), does what it says, and answers with one JSON line,
until the request pipe ends:

    {"op": "load", "solution": "solution.py", "entry_point": "f", "preamble": "..."}
        -> {"ok": true}  |  {"ok": false, "kind"?, "error_type", "error", "error_message"?}
    {"op": "call", "id": "<nonce>", "args": [...], "kwargs": {...}}
        -> {"id": "<nonce>", "ok": true, "value": ...}  |  {"id": ..., "ok": false, "error_type", "error", ...}

The candidate's code runs in this process, so it may read or write these pipes, patch this module
or exit: whatever comes back is at most *a value*, which the grader (``meshrl.envs.grading``)
decodes and judges in its own process, with the expected values it never sends here.

Values travel as data only -- JSON, with a one-key object for each builtin type JSON lacks:
``{"tuple": [...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"dict": [[k, v], ...]}``,
``{"bytes": "<hex>"}``, ``{"complex": [re, im]}``; floats may be NaN/Infinity. ``encode`` and
``decode`` are the grader's codec too: ``decode`` builds builtin types only and rejects anything
else (never pickle, never eval).
"""

import builtins
import io
import json
import os
import sys
import traceback

MAX_TEXT = 2000
MAX_DEPTH = 64
_TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "complex")
_SCALARS = (type(None), bool, int, float, str)


class CodecError(ValueError):
    """A value that cannot travel (not builtin data, too deep, or a malformed encoding)."""


def encode(value, depth=0):
    """``value`` (builtin data only; subclasses travel as their builtin base) as JSON-able data."""
    if depth > MAX_DEPTH:
        raise CodecError("the value is nested deeper than %d levels" % MAX_DEPTH)
    for base in _SCALARS:  # bool before int
        if isinstance(value, base):
            return value if type(value) is base else base(value)
    d = depth + 1
    if isinstance(value, list):
        return [encode(x, d) for x in value]
    if isinstance(value, tuple):
        return {"tuple": [encode(x, d) for x in value]}
    if isinstance(value, frozenset):
        return {"frozenset": [encode(x, d) for x in value]}
    if isinstance(value, set):
        return {"set": [encode(x, d) for x in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, d), encode(v, d)] for k, v in dict.items(value)]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, complex):
        return {"complex": [complex.__complex__(value).real, complex.__complex__(value).imag]}
    raise CodecError("a value of type %s cannot be sent (only None, bool, int, float, complex, str, bytes, "
                     "list, tuple, dict, set and frozenset)" % type(value).__name__)


def decode(data, depth=0):
    """Builtin data from ``encode``'s form; ``CodecError`` for anything else."""
    if depth > MAX_DEPTH:
        raise CodecError("the value is nested deeper than %d levels" % MAX_DEPTH)
    if type(data) in _SCALARS:
        return data
    d = depth + 1
    if type(data) is list:
        return [decode(x, d) for x in data]
    if type(data) is not dict or len(data) != 1:
        raise CodecError("not an encoded value: %s" % _short(repr(data), 100))
    (tag, body), = data.items()
    try:
        if tag in ("tuple", "set", "frozenset") and type(body) is list:
            items = [decode(x, d) for x in body]
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {decode(k, d): decode(v, d) for k, v in body}
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(body[0], body[1])
    except (TypeError, ValueError) as e:  # an unhashable set member or dict key, bad hex
        raise CodecError("not an encoded value: %s" % e) from None
    raise CodecError("not an encoded value: tag %s" % _short(repr(tag), 50))


def _short(text, limit=MAX_TEXT):
    text = str(text)
    return text if len(text) <= limit else text[: limit - 15] + "... [truncated]"


def format_exc(exc, keep):
    """The exception with its traceback limited to the frames whose file name ``keep`` accepts."""
    try:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if keep(f.filename)]
        lines = []
        if frames:
            lines.append("Traceback (most recent call last):\n")
            lines.extend(traceback.format_list(frames))
        lines.extend(traceback.format_exception_only(type(exc), exc))
        return _short("".join(lines))
    except BaseException:  # noqa: BLE001 -- a hostile __str__
        return "%s: <error formatting the exception>" % type(exc).__name__


def _error(exc, keep):
    try:
        message = _short(str(exc), 300)
    except BaseException:  # noqa: BLE001
        message = ""
    return {"ok": False, "error_type": type(exc).__name__, "error_message": message, "error": format_exc(exc, keep)}


class _Worker:
    def __init__(self, reply):
        self.reply = reply
        self.fn = None
        self.solution = "solution.py"

    def in_candidate(self, name):
        return name == self.solution or name.endswith("/" + self.solution)

    def send(self, obj):
        self.reply.write((json.dumps(obj) + "\n").encode("utf-8"))
        self.reply.flush()

    def load(self, req):
        self.solution = req["solution"]
        ns = {"__name__": "solution", "__file__": os.path.abspath(self.solution), "__builtins__": builtins}
        if req.get("preamble"):
            exec(compile(req["preamble"], "<preamble>", "exec"), ns)
        with open(self.solution, encoding="utf-8", errors="replace") as f:
            source = f.read()
        sys.argv = [self.solution]
        try:
            code = compile(source, self.solution, "exec")
        except (SyntaxError, ValueError) as e:
            return {"ok": False, "kind": "syntax_error", "error_type": type(e).__name__,
                    "error": _short("".join(traceback.format_exception_only(type(e), e)))}
        try:
            exec(code, ns)
        except SystemExit as e:
            if e.code not in (None, 0):
                return {"ok": False, "error_type": "SystemExit",
                        "error": "the code called exit(%s) while loading" % _short(repr(e.code), 100)}
        except BaseException as e:  # noqa: BLE001 -- anything the candidate raises
            return _error(e, self.in_candidate)
        fn = ns.get(req["entry_point"])
        if not callable(fn):
            return {"ok": False, "kind": "missing_entry_point", "error_type": "NameError",
                    "error": "the code does not define a function named '%s'" % req["entry_point"]}
        self.fn = fn
        return {"ok": True}

    def call(self, req):
        out = {"id": req["id"]}
        try:
            args = decode(req["args"])
            kwargs = {k: decode(v) for k, v in req["kwargs"].items()}
            value = self.fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- the candidate's error, reported as such
            out.update(_error(e, self.in_candidate))
            return out
        try:
            out.update(ok=True, value=encode(value))
            json.dumps(out)
        except (CodecError, ValueError, RecursionError) as e:
            out.update(ok=False, kind="test_failure", error_type="TypeError", error=_short(str(e), 300))
            out.pop("value", None)
        return out


def main():
    requests = os.fdopen(int(os.environ.pop("MESHRL_CALL_FD")), "rb")
    worker = _Worker(os.fdopen(int(os.environ.pop("MESHRL_REPLY_FD")), "wb"))
    try:  # nothing to read on stdin, and this file leaves the work directory
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    except OSError:
        pass
    sys.stdin = io.StringIO("")
    try:
        os.unlink(os.path.abspath(__file__))
    except OSError:
        pass
    worker.send({"ok": True})  # started: what follows is timed against the tests' limit
    for line in requests:
        req = json.loads(line)
        worker.send(worker.load(req) if req["op"] == "load" else worker.call(req))


if __name__ == "__main__":
    main()
