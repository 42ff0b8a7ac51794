"""Trajectory records: what a run keeps of every trajectory it sampled for training, one JSON object
per line of the run directory's `trajectories.jsonl`, and what `meshrl sft --trajectories` reads
back from such a file.

A record holds the trajectory token-in/token-out (`prompt_tokens`, the sampled `tokens` with the
environment's turns appended token-wise in multi-turn episodes, the sampler's `logprobs`, `mask` 1
exactly on the policy's sampled tokens), its `reward` and `reward_parts`, the policy `version` that
sampled it, `correct`, `termination`, its `error_sites` and whether its step `trained` on it, and
the trajectory's JSON-serialisable `info`; a multi-turn environment's own episode record (turns,
code, feedback, messages) is merged into the same line. The same token fields make a DiLoCo
rollout shard's records (meshrl.diloco.shards).

`sft_datum` turns a record back into a `cross_entropy` Datum from those token ids (loss weight on
the policy's sampled tokens only), never by decoding text and rendering it again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from meshrl.sdpo.sites import error_kind
from meshrl.training.conversations import json_object, text_lines, weighted_datum
from meshrl.types import Datum


class RecordFileError(ValueError):
    """A record file that cannot be used; the message is one line naming `file:line`."""


def jsonable(info: dict) -> dict:
    """The entries of ``info`` that survive JSON (others, e.g. a task object, are left out)."""
    out = {}
    for k, v in info.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def token_record(trajectory) -> dict:
    """A trajectory (meshrl.training.trajectories.Trajectory) as token ids exactly as sampled (never
    re-tokenised text), the sampler's logprobs and mask, reward, policy version, group, finish
    reason and its JSON-serialisable `info`."""
    t = trajectory
    return {"id": t.id, "group": t.group, "version": t.version, "prompt_tokens": list(t.prompt_tokens),
            "tokens": list(t.tokens), "logprobs": list(t.logprobs), "mask": list(t.mask), "reward": t.reward,
            "finish_reason": t.finish_reason, "info": jsonable(t.info)}


def error_sites(info: dict) -> list[dict]:
    """Where the trajectory went wrong: per failed turn of a multi-turn episode its index, error
    kind and hint template key (`turn_errors`); for a single-turn trajectory the verifier's error
    kind as turn 0 (none when it was correct or its grader failed)."""
    if "turn_errors" in info:
        return [{"turn": i, "error_kind": e.get("error_kind"), "hint_template_key": e.get("hint_template_key")}
                for i, e in enumerate(info["turn_errors"]) if e]
    kind = error_kind(info)
    return [{"turn": 0, "error_kind": kind, "hint_template_key": info.get("hint_template_key")}] if kind else []


def trajectory_record(trajectory, step: int, trained: bool, episode: dict | None = None) -> dict:
    """One line of `trajectories.jsonl`: ``trajectory`` sampled for step ``step`` (``trained``:
    its step trained on it; False for a group dropped as uniform or stale), with ``episode``, the
    environment's own record of it (multi-turn), merged in: the trajectory's fields win a clash
    (`reward` is the trained reward, the environment's sum is `reward_parts.task`)."""
    info = trajectory.info
    penalty = float(info.get("overlong_penalty", 0.0))
    record = {"kind": "trajectory", "step": step, "trained": trained, **token_record(trajectory),
              "reward_parts": {"task": trajectory.reward - penalty, "overlong_penalty": penalty},
              "correct": bool(info.get("correct")),
              "termination": info.get("termination") or trajectory.finish_reason,
              "error_sites": error_sites(info)}
    return {**(episode or {}), **record}


def append_records(path: Path, records: list[dict]) -> None:
    """Append ``records`` as JSON lines and flush them to disk (a crash loses no finished step)."""
    if not records:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def truncate_records(path: Path, step: int) -> int:
    """Drop the records of steps after ``step`` (they are about to be redone after a resume or a
    learner restore) and a last line a crash left unfinished; returns how many lines went."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(record, dict) and int(record.get("step") or 0) > step:
            dropped += 1
            continue
        kept.append(line + "\n")
    if dropped:
        path.write_text("".join(kept), encoding="utf-8")
    return dropped


def read_records(path: str | Path) -> list[tuple[str, dict]]:
    """(`file:line`, record) for every line of a JSONL record file (blank lines skipped); raises
    `RecordFileError` for a missing or non-UTF-8 file and for a line that is not a JSON object."""
    return [(where, json_object(line, where, RecordFileError)) for where, line in text_lines(path, RecordFileError)]


def token_ids(record: dict, key: str, where: str) -> list[int]:
    """``record[key]`` as a list of token ids (non-negative integers); RecordFileError naming the
    line and the field otherwise."""
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                              for x in value):
        got = "missing" if key not in record else "not a list of non-negative integers"
        raise RecordFileError(f"{where}: `{key}` must be a list of token ids, got {got}")
    return value


def successful(record: dict, min_reward: float | None) -> bool:
    """The rule `meshrl sft --trajectories` trains by: the record's `correct` flag, or with
    ``min_reward`` set, `reward` >= it."""
    if min_reward is None:
        return record.get("correct") is True
    reward = record.get("reward")
    return isinstance(reward, (int, float)) and not isinstance(reward, bool) and reward >= min_reward


def sft_datum(record: dict, where: str, max_length: int) -> Datum | None:
    """The `cross_entropy` Datum of a trajectory record: its prompt and sampled token ids as
    recorded, weight 1 exactly where `mask` is 1 (the policy's own tokens; the prompt and an
    environment's turns weigh 0), cut to ``max_length`` tokens. None when no sampled token is left
    after the cut; RecordFileError for a malformed record."""
    prompt, tokens, mask = (token_ids(record, k, where) for k in ("prompt_tokens", "tokens", "mask"))
    if len(mask) != len(tokens) or any(m not in (0, 1) for m in mask):
        raise RecordFileError(f"{where}: `mask` must hold one 0 or 1 per token of `tokens` "
                              f"({len(mask)} values for {len(tokens)} tokens)")
    return weighted_datum(prompt + tokens, [0] * len(prompt) + mask, max_length)
