"""An agent program for tests/test_agents_runtime.py: the official `openai` client, two turns of one
conversation (the reply object appended as the client returns it), logprobs asked for; it writes
what the endpoint answered to $AGENT_LOG_DIR/<episode_id>.json and prints its reward."""

import json
import os
import sys

from openai import OpenAI

episode = json.loads(sys.stdin.read())
client = OpenAI(max_retries=0)
messages = [{"role": "user", "content": f"Name a colour. ({episode['seed']})"}]
seen = []
for turn in range(2):
    r = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    choice = r.choices[0]
    seen.append({"content": choice.message.content, "fingerprint": r.system_fingerprint,
                 "logprobs": [t.logprob for t in choice.logprobs.content],
                 "tokens": [t.token for t in choice.logprobs.content], "finish_reason": choice.finish_reason})
    messages += [choice.message, {"role": "user", "content": "Another one."}]
with open(os.path.join(os.environ["AGENT_LOG_DIR"], f"{episode['episode_id']}.json"), "w") as f:
    json.dump(seen, f)
print(json.dumps({"reward": float(len(seen[0]["content"]) % 3), "success": True}))
