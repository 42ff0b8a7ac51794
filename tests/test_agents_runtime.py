"""`task.kind: agent` end to end: real Monarch processes, the packaged 135M model on the real
generator, and an agent program run as a subprocess that talks to meshrl's endpoint with the real
`openai` client. The trajectory meshrl assembles must equal, token for token, what the generator
sampled (recorded where the controller receives the generator's replies) and what the agent was
served."""

import json
from pathlib import Path

import pytest

from meshrl.controller.train import make_run_dir, run_training
from meshrl.meshes.client import MeshClient
from meshrl.metrics.records import read_metrics

pytestmark = pytest.mark.monarch
HERE = Path(__file__).resolve().parent


@pytest.mark.slow  # a real model on 2 cores: about two minutes
@pytest.mark.timeout(1500)
def test_an_openai_client_agent_trains_on_exactly_what_the_generator_sampled(tiny_run_config, tmp_path, monkeypatch):
    sampled = []  # (prompt, completion) as the generator returned them
    original = MeshClient.sample

    def spy(self, prompt, request, scoring):
        out = original(self, prompt, request, scoring)
        sampled.append((list(prompt), out.completions[0]))
        return out

    monkeypatch.setattr(MeshClient, "sample", spy)
    logs = tmp_path / "agent-logs"
    logs.mkdir()
    monkeypatch.setenv("AGENT_LOG_DIR", str(logs))
    cfg = tiny_run_config("output.name=agent-real", "model.name_or_path=smollm2-135m-instruct", "task.kind=agent",
                          f"task.agent.command=[python,{HERE / 'agents' / 'openai_agent.py'}]",
                          "task.agent.timeout_s=600", "trainer.steps=2", "trainer.prompts_per_step=2",
                          "trainer.group_size=2", "trainer.eval.every=0", "trainer.eval.at_start=false",
                          "trainer.checkpoint.every=0", "trainer.checkpoint.export_final=false", "learner.lr=1e-5",
                          "generator.sampling.max_new_tokens=12")
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["agents/segments"] == 4 and r["agents/calls"] == 8 for r in train)
    assert not any(k in r for r in train for k in ("agents/crashed", "agents/timed_out", "agents/rejected"))
    records = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    trajectories = [r for r in records if r["kind"] == "trajectory"]
    assert len(trajectories) == 8 and len(sampled) == 16
    unmatched = list(sampled)  # each completion the generator sampled is trained exactly once
    for r in trajectories:
        tokens, mask, logprobs = r["prompt_tokens"] + r["tokens"], [0] * len(r["prompt_tokens"]) + r["mask"], \
            [0.0] * len(r["prompt_tokens"]) + r["logprobs"]
        spans = [(s + len(r["prompt_tokens"]), e + len(r["prompt_tokens"])) for _, _, s, e in r["info"]["turns"]]
        served = json.loads((logs / f"{r['id']}.json").read_text())
        assert len(spans) == 2 == len(served)
        for (start, end), turn in zip(spans, served):
            # the span is one completion of the generator, sampled in exactly this context
            [match] = [i for i, (p, c) in enumerate(unmatched)
                       if p == tokens[:start] and c.tokens == tokens[start:end] and c.logprobs == logprobs[start:end]]
            _, completion = unmatched.pop(match)
            assert mask[start:end] == [1] * (end - start) and completion.meta["version"] == r["step"] - 1
            # and it is what the agent was served
            content = completion.tokens[:-1] if completion.finish_reason == "stop" else completion.tokens
            assert turn["logprobs"] == completion.logprobs[:len(content)] and len(turn["tokens"]) == len(content)
            assert turn["fingerprint"] == f"meshrl-policy-v{r['step'] - 1}"
        assert sum(mask) == sum(e - s for s, e in spans)  # nothing else is trained
        assert r["version"] == r["step"] - 1
    assert unmatched == []
