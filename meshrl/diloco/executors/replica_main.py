"""What runs inside one replica, whatever the executor:

    python -m meshrl.diloco.executors.replica_main --spec SPEC.json --replica I --replicas N --result OUT.json

calls the spec's function and writes ``{"result": {...}}`` to OUT.json (atomically: a temporary
file, then a rename), or ``{"error": "..."}`` and exit status 1 if the function raised. A replica
killed before it finished writes nothing; its executor reports how the process ended.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path

from meshrl.diloco.executors.base import ReplicaSpec

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def run_spec(spec: ReplicaSpec, replica: int, replicas: int) -> dict:
    """``{"result": ...}`` or ``{"error": "<exception type>: <message>"}`` (traceback on stderr)."""
    try:
        return {"result": spec.run(replica, replicas)}
    except Exception as e:  # noqa: BLE001 - the replica's failure is its result
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}


@contextlib.contextmanager
def output_to(path: Path):
    """Send this process's print output and log records to ``path`` (appending) while inside."""
    with open(path, "a", buffering=1, encoding="utf-8") as f, \
            contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        handler = logging.StreamHandler(f)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root = logging.getLogger()
        level = root.level
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        try:
            yield
        finally:
            root.removeHandler(handler)
            root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replica_main", description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    out = run_spec(ReplicaSpec.from_json(args.spec.read_text()), args.replica, args.replicas)
    write_json(args.result, out)
    return 0 if "result" in out else 1


if __name__ == "__main__":
    sys.exit(main())
