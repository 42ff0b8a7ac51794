"""A tool-calling episode end to end: `meshrl train` with the packaged SmolLM2-135M (the real renderer
and generator) on `MultiplyEnv` in the env mesh's processes (real Monarch processes): the model calls
the calculator in the `<tool_call>` format, the result comes back as a tool turn appended token-in/
token-out, and the model answers. The worked example of each episode is its own question, so the
model copies the call (the test is about the machinery, not about the model)."""

import json

import pytest

from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.controller.train import make_run_dir, run_training
from meshrl.metrics.records import read_metrics
from meshrl.renderers import renderer_for_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.monarch]


@pytest.mark.timeout(1200)
def test_a_tool_calling_episode_through_the_real_renderer_and_generator(tmp_path, smollm_tokenizer):
    cfg = load_config(RunConfig, "configs/env-tools.yaml", [
        f"output.dir={tmp_path}", "output.name=tools", "trainer.steps=1", "trainer.prompts_per_step=2",
        "trainer.group_size=2", "trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.progress=false",
        "trainer.checkpoint.every=0", "trainer.checkpoint.export_final=false", "generator.sampling.temperature=0.1",
        "task.env.kwargs={low: 317, high: 317, examples: [[317, 317]]}"])
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["tools/calls"] >= 1
    renderer = renderer_for_tokenizer(smollm_tokenizer)
    episodes = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    called = [e for e in episodes if e.get("tool_calls")]
    assert called, [smollm_tokenizer.decode(e["tokens"]) for e in episodes]
    for e in called:
        tokens, mask = e["tokens"], e["mask"]
        first_end = e["info"]["turns"][0][3]
        second_start = e["info"]["turns"][1][2]
        assert not any(mask[first_end:second_start]) and all(mask[:first_end])  # env tokens untrained
        # the first turn was sampled and holds the call the environment ran
        sampled = smollm_tokenizer.decode(tokens[:first_end])
        assert renderer.parse_tool_calls(sampled.replace("<|im_end|>", ""))[1][0].name == "calculator"
        assert e["tool_calls"][0]["result"] == str(317 * 317)
        # the tool turn, appended as tokens (never re-rendered), is the template's text of that turn
        between = tokens[first_end:second_start]
        text = ("\n<|im_start|>user\n<tool_response>\n100489\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        closing = [] if tokens[first_end - 1] == renderer.get_stop_sequences()[0] else renderer.get_stop_sequences()
        assert between == closing + list(smollm_tokenizer.encode(text, add_special_tokens=False))
    assert any(e["info"]["correct"] for e in called)  # and it answered with the tool's result
