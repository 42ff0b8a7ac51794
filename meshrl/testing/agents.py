"""Agent programs and a grader for tests of `task.kind: agent`: `scripted` behaves as its episode's
`mode` says (a well-behaved two-turn conversation, one that rewrites its history, and every way a
program can fail), `first_reply_length` grades a transcript."""

from __future__ import annotations

import time


def scripted(client, episode: dict):
    mode = episode.get("mode", "good")
    ask = lambda messages: client.chat.completions.create(model="policy", messages=messages)  # noqa: E731
    if mode == "no_calls":
        return 1.0
    if mode == "crash":
        raise RuntimeError("the agent's own bug")
    if mode == "hang":
        time.sleep(60)
    messages = [{"role": "user", "content": f"Say something about {episode.get('seed', 0)}."}]
    reply = ask(messages).choices[0].message
    if mode == "rewrite":  # a second conversation that does not extend the first
        ask([{"role": "user", "content": "Something else entirely."}])
        return {"reward": 0.5, "success": False}
    messages += [reply, {"role": "user", "content": "And then?"}]
    ask(messages)
    if mode == "garbage":
        return "a string, not a reward"
    return {"reward": 1.0}


def first_reply_length(episode: dict, transcript: dict) -> float:
    """The number of characters of the first reply served (and the program's result must be there)."""
    assert "result" in transcript
    return float(len(transcript["calls"][0]["reply"]))
