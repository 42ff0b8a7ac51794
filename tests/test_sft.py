"""`meshrl sft`: the conversation file (one-line errors naming file:line), the Datums built from it
token in and token out, the held-out split, its config section, and real runs on the tiny model:
the NLL falls, checkpoints and metrics are written, a resumed run continues where the checkpoint
left off, and a LoRA run's directory can be evaluated."""

import json
import shutil

import pytest

from meshrl.cli import main
from meshrl.config.base import load_config
from meshrl.config.sft import SFTRunConfig
from meshrl.controller.sft import sft_main
from meshrl.controller.sft_data import load_data
from meshrl.training.conversations import ConversationFileError, read_conversations, supervised_datum
from tests.conftest import TINY_RUN

GOOD = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
                     {"role": "assistant", "content": "6"}]}


def _write(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


# ---- the file ----------------------------------------------------------------------------------------
def test_a_good_file_reads_every_conversation(tmp_path):
    path = _write(tmp_path / "data.jsonl", [GOOD, "", {"messages": [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "hello"}],
                                                       "id": "extra keys are ignored"}])
    convs = read_conversations(path)
    assert len(convs) == 2 and convs[0] == GOOD["messages"]
    assert convs[1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("line, expected", [
    ('{"messages": [', "not JSON ("),
    ("[1, 2]", "expected a JSON object with a `messages` list, got a array"),
    ('{"conversation": []}', "no `messages` key (keys: conversation)"),
    ('{"messages": []}', "`messages` must be a non-empty array of messages, got an empty array"),
    ('{"messages": "hi"}', "`messages` must be a non-empty array of messages, got a string"),
    ('{"messages": ["hi"]}', "message 0 is a string, not an object"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', 'message 0: unknown role "robot" (expected one of system, '
                                                           'user, assistant, tool)'),
    ('{"messages": [{"content": "x"}]}', "message 0: unknown role null"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}',
     "message 1 (assistant): `content` must be a string, got a null"),
    ('{"messages": [{"role": "user"}]}', "message 0 (user): `content` must be a string, got missing"),
    ('{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "`content` must be a string, got a array"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}',
     "no assistant message (nothing to train on)"),
])
def test_a_bad_line_is_one_error_naming_the_file_and_line(tmp_path, line, expected):
    path = _write(tmp_path / "data.jsonl", [GOOD, GOOD, "", line, GOOD])
    with pytest.raises(ConversationFileError) as err:
        read_conversations(path)
    message = str(err.value)
    assert message.startswith(f"{path}:4: ") and expected in message and "\n" not in message, message


def test_a_missing_empty_or_binary_file(tmp_path):
    for content, expected in ((None, "no such file"), ("\n\n", "no conversations in it"),
                              (b"\xff\xfe{", "not a UTF-8 text file")):
        path = tmp_path / "f.jsonl"
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(ConversationFileError, match=expected):
            read_conversations(path)
        path.unlink(missing_ok=True)


# ---- Datums: the renderer's tokens, weight on the assistant turns --------------------------------------
def test_the_datum_is_the_renderers_tokens_with_weight_on_the_assistant_turns(smollm_tokenizer):
    from meshrl.renderers import renderer_for_tokenizer

    renderer = renderer_for_tokenizer(smollm_tokenizer)
    messages = GOOD["messages"]
    d = supervised_datum(renderer, messages, 4096)
    tokens = renderer.render(messages)
    assert d.model_input.to_ints() == tokens[:-1] and d.loss_fn_inputs["target_tokens"].tolist() == tokens[1:]
    weights = d.loss_fn_inputs["weights"].tolist()
    trained = [t for t, w in zip(tokens[1:], weights) if w]
    assert smollm_tokenizer.decode(trained) == "4<|im_end|>6<|im_end|>"
    last = supervised_datum(renderer, messages, 4096, only_last_assistant=True)
    assert smollm_tokenizer.decode([t for t, w in zip(tokens[1:], last.loss_fn_inputs["weights"].tolist()) if w]) \
        == "6<|im_end|>"
    # cut to 8 tokens: no assistant token left, skipped
    assert supervised_datum(renderer, messages, 8) is None
    cut = supervised_datum(renderer, messages, len(tokens) - 3)
    assert cut.model_input.length == len(tokens) - 4


def test_the_held_out_split(tmp_path):
    convs = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(20)]
    data = _write(tmp_path / "data.jsonl", convs)

    def cfg(*overrides):
        return load_config(SFTRunConfig, None, [f"sft.data={data}", *overrides])

    def split(*overrides):
        data = load_data(cfg(*overrides))
        return data.train, data.held

    train, held = split()
    assert len(train) == 18 and len(held) == 2
    assert not {c[1]["content"] for c in train} & {c[1]["content"] for c in held}
    assert split() == (train, held)  # the same split every time (a resumed run)
    assert split("sft.seed=1")[1] != held
    assert split("sft.eval_fraction=0") == ([c["messages"] for c in convs], [])
    other = _write(tmp_path / "held.jsonl", convs[:3])
    assert split(f"sft.eval_data={other}") == ([c["messages"] for c in convs], [c["messages"] for c in convs[:3]])


def test_every_sft_setting_is_read_and_unknown_keys_are_refused():
    from meshrl.config.base import ConfigError
    from tests.test_config_fields_read import _code_outside_config, unread_fields

    assert not [f for f in unread_fields(SFTRunConfig, _code_outside_config()) if f.startswith("SFTConfig.")]
    with pytest.raises(ConfigError, match="unknown key 'sft.batch'"):
        load_config(SFTRunConfig, None, ["sft.batch=4"])


def test_the_cli_refuses_a_bad_line_before_making_anything(tmp_path, capsys):
    data = _write(tmp_path / "data.jsonl", [GOOD, GOOD, '{"messages": [{"role": "user", "content": 3}]}'])
    out = tmp_path / "runs"
    assert main(["sft", data, *TINY_RUN, f"output.dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err == f"meshrl: sft: {data}:3: message 0 (user): `content` must be a string, got a number\n"
    assert not out.exists()
    # the held-out file (--eval-file) is checked as well
    good = _write(tmp_path / "good.jsonl", [GOOD])
    assert main(["sft", good, *TINY_RUN, f"output.dir={out}", "--eval-file", data]) == 2
    assert capsys.readouterr().err.startswith(f"meshrl: sft: {data}:3: ")
    assert main(["sft", "--resume", str(tmp_path), "learner.lr=1"]) == 2
    assert "continues the run with its saved config" in capsys.readouterr().err


# ---- real runs ---------------------------------------------------------------------------------------------
def _arithmetic(tmp_path, repeat: int = 4) -> str:
    """A tiny repeated data set: four additions answered in one fixed format."""
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": f"The answer is {a + b}."}]}
            for a, b in ((12, 30), (21, 14), (33, 11), (40, 17))]
    return _write(tmp_path / "data.jsonl", rows * repeat)


def _records(run_dir, kind):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


@pytest.mark.monarch
@pytest.mark.slow  # ~11 s on 2 cores
def test_sft_trains_checkpoints_and_resumes(tiny_session, tmp_path, capsys):
    data = _arithmetic(tmp_path)
    cfg = load_config(SFTRunConfig, None, [
        *TINY_RUN, f"output.dir={tmp_path}", "output.name=sft", f"sft.data={data}", "sft.batch_size=4", "sft.steps=4",
        "sft.eval_every=2", "sft.eval_fraction=0.25", "trainer.checkpoint.every=2",
        "trainer.checkpoint.export_final=false"])
    assert sft_main(cfg, session=tiny_session) == 0
    assert "held-out NLL" in capsys.readouterr().out
    run_dir = tmp_path / "sft"
    train, evals = _records(run_dir, "train"), _records(run_dir, "eval")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    assert train[-1]["train/nll"] < train[0]["train/nll"] and evals[-1]["eval/nll"] < evals[0]["eval/nll"]
    assert [r["train/lr"] for r in train] == pytest.approx([5e-3 * (1 - s / 4) for s in range(4)])  # linear decay
    assert all(r["batch/datums"] == 4 and r["train/loss_tokens"] > 0 for r in train) and evals[0]["eval/n"] == 4
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert "sft:" in (run_dir / "config.yaml").read_text()

    # a run cut short after step 2's checkpoint continues from it: steps 3 and 4 again, as before
    shutil.rmtree(run_dir / "checkpoints" / "step-000004")
    assert sft_main(None, resume=str(run_dir), session=tiny_session) == 0
    resumed = _records(run_dir, "train")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["train/nll"] for r in resumed] == pytest.approx([r["train/nll"] for r in train], rel=1e-4)
    assert _records(run_dir, "eval")[-1]["eval/nll"] == pytest.approx(evals[-1]["eval/nll"], rel=1e-4)

    from meshrl.report import write_report

    _, md, panels = write_report(run_dir)
    loss = next(p for p in panels if p.title == "Loss terms")
    assert loss.artists == 2  # train and held-out NLL
    assert "steps 1-4" in md.read_text()


@pytest.mark.monarch
@pytest.mark.slow  # ~7 s on 2 cores
def test_a_lora_sft_run_exports_and_its_directory_evaluates(tiny_session, tmp_path, capsys):
    from meshrl.controller.evaluate import eval_main

    data = _arithmetic(tmp_path, repeat=2)
    held = _write(tmp_path / "held.jsonl", [json.loads(line) for line in open(data).read().splitlines()[:2]])
    cfg = load_config(SFTRunConfig, None, [*TINY_RUN, f"output.dir={tmp_path}", "output.name=lora2", f"sft.data={data}",
                                           f"sft.eval_data={held}", "learner.lora.enabled=true", "sft.batch_size=4",
                                           "sft.lr_schedule=constant"])
    assert sft_main(cfg, session=tiny_session) == 0
    run_dir = tmp_path / "lora2"
    train = _records(run_dir, "train")
    assert len(train) == 2 and all(r["train/lr"] == 5e-3 for r in train)  # one epoch of 8 conversations
    assert json.loads((run_dir / "checkpoints" / "step-000002" / "learner" / "learner.json").read_text())["lora"]
    assert (run_dir / "final_model" / "config.json").is_file()
    capsys.readouterr()
    assert eval_main(str(run_dir), overrides=["trainer.eval.size=4"], session=tiny_session) == 0
    assert "lora2 (latest checkpoint, step 2): held-out arithmetic, 4 problems, greedy" in capsys.readouterr().out
