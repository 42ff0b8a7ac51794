"""A black-box agent program: it plays one episode with the official `openai` client and keeps its own
loop, so meshrl sees only its requests to the endpoint and the result it returns.

"What is a + b?" with three attempts; the program checks each answer itself and, after a wrong one,
tells the model whether it was too high or too low and which ten the sum lies in, then the sum itself.
Reward 1.0, 0.6 or 0.3 for a correct first, second or third answer, 0 otherwise.

Run by meshrl once per episode, either as a callable in the controller's threads
(`task.agent.callable: agent_program:play`, configs/agent.yaml) or as a subprocess
(`task.agent.command: [python, examples/agent_program.py]`): then the client reads
OPENAI_BASE_URL and OPENAI_API_KEY from the environment, the episode comes on stdin, and the
result is the last line printed.
"""

import json
import random
import re
import sys

from openai import OpenAI

REWARDS = (1.0, 0.6, 0.3)
PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]
random.Random(0).shuffle(PAIRS)
HELD_OUT = 200  # the first pairs are held out; training episodes draw from the rest


def problem(episode: dict) -> tuple[int, int]:
    seed = episode.get("seed", 0)
    if episode.get("split") == "test":
        return PAIRS[seed % HELD_OUT]
    return PAIRS[HELD_OUT + seed % (len(PAIRS) - HELD_OUT)]


def last_integer(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def play(client: OpenAI, episode: dict) -> dict:
    a, b = problem(episode)
    answer = a + b
    messages = [{"role": "user", "content": f"What is {a} + {b}? Reply with the number."}]
    for attempt, reward in enumerate(REWARDS):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        got = last_integer(reply)
        if got == answer:
            return {"reward": reward, "success": True}
        said = "You gave no number." if got is None else f"{got} is too {'high' if got > answer else 'low'}."
        if attempt == 0:
            low = answer // 10 * 10
            messages.append({"role": "user", "content": f"{said} Clue: the sum is between {low} and {low + 9}. Try again."})
        else:
            messages.append({"role": "user", "content": f"{said} The sum is {answer}. Reply with it."})
    return {"reward": 0.0, "success": False}


if __name__ == "__main__":
    print(json.dumps(play(OpenAI(max_retries=0), json.loads(sys.stdin.read()))))
