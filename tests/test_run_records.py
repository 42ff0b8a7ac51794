"""The run's data files: trajectory records (token ids, logprobs, reward and its parts, version,
error sites, termination, the environment's own record merged in), teacher pair records, appending
and truncating them step by step, and reading them back as `meshrl sft` training data (successful
trajectories as `cross_entropy` Datums, pairs as `dpo` Datum pairs), with hand-checked values."""

import json

import pytest
import torch

from meshrl.config.base import load_config
from meshrl.config.sft import SFTRunConfig
from meshrl.controller.run_records import RunRecords
from meshrl.controller.sft import heldout_preference
from meshrl.controller.sft_data import SFTError, check_vocabulary, load_data, units
from meshrl.replay.agreement import PreferencePair
from meshrl.replay.pairs import PreferenceItem, pair_record
from meshrl.replay.trace import ReplayPair
from meshrl.testing.fake_meshes import UniformForEvenOperand, make_loop
from meshrl.training.records import (RecordFileError, append_records, sft_datum, trajectory_record,
                                     truncate_records)
from meshrl.training.trajectories import Trajectory


def _single(**info):
    return Trajectory(id="p1-s0", group=3, problem=object(), prompt_tokens=[5, 6], tokens=[7, 8], logprobs=[-0.5, -1.5],
                      mask=[1, 1], version=4, response_text="78", finish_reason="stop", reward=0.75, info=info)


def _multi():
    turn_errors = [{"error_kind": "syntax_error", "hint": "close the bracket", "hint_template_key": "syntax_error",
                    "error_text": "SyntaxError", "tests_passed": 0, "tests_total": 3}, None]
    info = {"correct": True, "termination": "success", "turns": [([{"role": "user", "content": "q"}], "a", 0, 2),
                                                                 ([{"role": "user", "content": "q2"}], "b", 3, 4)],
            "turn_errors": turn_errors}
    return Trajectory(id="train0-0-1", group=0, problem=object(), prompt_tokens=[1, 2], tokens=[10, 11, 90, 12],
                      logprobs=[-0.1, -0.2, 0.0, -0.3], mask=[1, 1, 0, 1], version=2, finish_reason="stop", reward=1.0,
                      info=info)


# ---- trajectory records ------------------------------------------------------------------------------
def test_a_single_turn_record_keeps_tokens_reward_parts_and_its_error_site():
    t = _single(correct=False, format_ok=True, overlong_penalty=-0.25)
    r = trajectory_record(t, step=7, trained=True)
    assert r["kind"] == "trajectory" and r["step"] == 7 and r["trained"] is True
    assert (r["id"], r["group"], r["version"]) == ("p1-s0", 3, 4)
    assert (r["prompt_tokens"], r["tokens"], r["logprobs"], r["mask"]) == ([5, 6], [7, 8], [-0.5, -1.5], [1, 1])
    # the trained reward 0.75 includes the overlong penalty -0.25: the task's own reward was 1.0
    assert r["reward"] == 0.75 and r["reward_parts"] == {"task": 1.0, "overlong_penalty": -0.25}
    assert r["correct"] is False and r["termination"] == "stop"
    assert r["error_sites"] == [{"turn": 0, "error_kind": "wrong_answer", "hint_template_key": None}]
    assert json.loads(json.dumps(r)) == r  # the task object is left out of `info`
    assert trajectory_record(_single(correct=True), 1, False)["error_sites"] == []
    assert trajectory_record(_single(error="grader raised"), 1, False)["error_sites"] == []  # no evidence


def test_a_multi_turn_record_has_per_turn_error_sites_and_the_envs_record_merged_in():
    episode = {"episode_id": "train0-0-1", "num_turns": 2, "reward": 0.5, "termination": "success",
               "turns": [{"code": "x(", "feedback": "SyntaxError", "error_kind": "syntax_error"},
                         {"code": "x()", "feedback": "ok", "error_kind": None}],
               "messages": [{"role": "user", "content": "q"}]}
    r = trajectory_record(_multi(), 2, True, episode)
    assert r["error_sites"] == [{"turn": 0, "error_kind": "syntax_error", "hint_template_key": "syntax_error"}]
    assert r["termination"] == "success" and r["correct"] is True
    assert r["mask"] == [1, 1, 0, 1] and r["logprobs"] == [-0.1, -0.2, 0.0, -0.3]
    # one line: the env's fields stay, the trajectory's win a clash (its reward is the trained one)
    assert r["episode_id"] == "train0-0-1" and r["turns"] == episode["turns"] and r["messages"] == episode["messages"]
    assert r["reward"] == 1.0 and r["info"]["turn_errors"][1] is None


def test_records_append_and_truncate_to_a_step(tmp_path):
    path = tmp_path / "t.jsonl"
    append_records(path, [{"step": 1, "id": "a"}, {"step": 2, "id": "b"}])
    append_records(path, [])
    append_records(path, [{"step": 3, "id": "c"}])
    with open(path, "a") as f:
        f.write('{"step": 3, "id": "torn')  # a crash in the middle of a line
    assert truncate_records(path, 2) == 2
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b"]
    assert truncate_records(path, 2) == 0 and truncate_records(tmp_path / "none.jsonl", 0) == 0


def test_the_loop_writes_one_record_per_sampled_trajectory_and_marks_what_it_trained(tmp_path):
    loop, _, _ = make_loop(rewarder=UniformForEvenOperand, **{"trainer.prompts_per_step": 4, "trainer.group_size": 4,
                                                              "trainer.advantage.drop_uniform_groups": "true",
                                                              "trainer.advantage.max_extra_rounds": 0})
    files = RunRecords(tmp_path, loop)
    try:
        for step in (1, 2):
            _, trained = loop.step()
            files.write_step(step, trained)
    finally:
        loop.close()
    records = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] * 16 + [2] * 16
    last = {t.id: t for t in loop.sampled}
    assert [r["id"] for r in records[16:]] == [t.id for t in loop.sampled]
    for r in records[16:]:
        t = last[r["id"]]
        assert (r["prompt_tokens"], r["tokens"], r["logprobs"], r["reward"]) == (t.prompt_tokens, t.tokens,
                                                                              t.logprobs, t.reward)
    # groups with all-equal rewards (even first operand) were sampled, recorded and not trained on
    assert {r["trained"] for r in records} == {True, False}
    flags: dict = {}
    for r in records:
        flags.setdefault((r["step"], r["group"]), set()).add(r["trained"])
    assert all(len(f) == 1 for f in flags.values())  # a group is trained or dropped whole
    files.truncate_after(1)
    assert {json.loads(line)["step"] for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()} == {1}


# ---- pair records ----------------------------------------------------------------------------------------
def _pair_record(key, chosen, rejected, identical=False, status_trains=True):
    pref = PreferencePair(chosen="The answer is 4.", rejected="5", chosen_canonical="4", rejected_canonical="5",
                          votes=2, n_teachers=3, n_answered=3, agreeing_teachers=("t0", "t1"))
    pair = ReplayPair("e1", 0, [{"role": "user", "content": "2+2?"}], pref)
    return pair_record(PreferenceItem(key, [1, 2, 3], chosen, rejected), 5, pair, version=4, trace_cost_usd=0.03,
                       trace_pairs=2, trains=status_trains, identical=identical)


def test_a_pair_record_keeps_tokens_texts_teachers_agreement_and_cost():
    r = _pair_record("v4/e1/0", [40, 2], [50, 2])
    assert (r["kind"], r["step"], r["key"], r["version"]) == ("preference", 5, "v4/e1/0", 4)
    assert (r["prompt_tokens"], r["chosen"], r["rejected"]) == ([1, 2, 3], [40, 2], [50, 2])
    assert r["context"] == [{"role": "user", "content": "2+2?"}]
    assert (r["chosen_text"], r["rejected_text"]) == ("The answer is 4.", "5")
    assert r["teachers"] == ["t0", "t1"] and (r["votes"], r["n_teachers"], r["agreement"]) == (2, 3, "2 of 3")
    assert r["trace_cost_usd"] == 0.03 and r["cost_usd"] == pytest.approx(0.015)  # the trace's spend over its 2 pairs
    assert (r["status"], r["drop_reason"]) == ("buffered", None)
    assert _pair_record("k", [5, 2], [5, 2], identical=True)["status"] == "dropped"
    assert _pair_record("k", [40, 2], [50, 2], status_trains=False)["status"] == "exported"


# ---- reading the files back for meshrl sft -------------------------------------------------------------
def test_a_trajectory_becomes_a_datum_of_its_recorded_tokens_weighted_on_sampled_tokens_only():
    record = trajectory_record(_multi(), 1, True)
    d = sft_datum(record, "f:1", 64)
    # sequence 1 2 | 10 11 90 12: the model reads all but the last, predicts all but the first
    assert d.model_input.to_ints() == [1, 2, 10, 11, 90]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 10, 11, 90, 12]
    assert d.loss_fn_inputs["weights"].tolist() == [0, 1, 1, 0, 1]  # the env's token 90 and the prompt weigh 0
    assert sft_datum(record, "f:1", 4).loss_fn_inputs["weights"].tolist() == [0, 1, 1]  # cut to 4 tokens
    assert sft_datum(record, "f:1", 2) is None  # nothing sampled left
    with pytest.raises(RecordFileError, match=r"^f:1: `mask` must hold one 0 or 1 per token"):
        sft_datum({**record, "mask": [1, 1]}, "f:1", 64)
    with pytest.raises(RecordFileError, match=r"^f:1: `tokens` must be a list of token ids, got not a list"):
        sft_datum({**record, "tokens": [1, -2]}, "f:1", 64)


def _cfg(*overrides):
    return load_config(SFTRunConfig, None, ["model.max_model_len=64", "sft.eval_fraction=0", *overrides])


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_sft_trains_on_the_successful_trajectories_of_a_file(tmp_path):
    good = trajectory_record(_multi(), 1, True)
    bad = {**trajectory_record(_single(correct=False), 1, True), "reward": 0.2}
    path = _write(tmp_path / "trajectories.jsonl", [good, bad, {"kind": "episode", "episode_id": "eval0-0-0"}, good])
    data = load_data(_cfg(f"sft.trajectories={path}"))
    assert (data.source, data.loss, len(data.train), data.skipped) == ("trajectories", "cross_entropy", 2, 1)
    assert data.train[0].model_input.to_ints() == [1, 2, 10, 11, 90]
    # by reward instead: both >= 0.2 count, one > 0.5 does
    assert len(load_data(_cfg(f"sft.trajectories={path}", "sft.min_reward=0.2")).train) == 3
    assert len(load_data(_cfg(f"sft.trajectories={path}", "sft.min_reward=0.5")).train) == 2
    with pytest.raises(SFTError, match=r"no successful trajectory to train on \(reward >= 5 \(sft.min_reward\); 3 not"):
        load_data(_cfg(f"sft.trajectories={path}", "sft.min_reward=5"))
    broken = _write(tmp_path / "broken.jsonl", [good, "{not json"])
    with pytest.raises(RecordFileError, match=rf"^{broken}:2: not JSON"):
        load_data(_cfg(f"sft.trajectories={broken}"))
    with pytest.raises(SFTError, match="sft.data and sft.trajectories are all set"):
        load_data(_cfg(f"sft.trajectories={path}", f"sft.data={path}"))
    with pytest.raises(SFTError, match="no training file given"):
        load_data(_cfg())


def test_offline_dpo_reads_the_pairs_that_were_not_dropped(tmp_path):
    kept = _pair_record("a", [40, 2], [50, 2])
    path = _write(tmp_path / "pairs.jsonl", [kept, _pair_record("b", [5, 2], [5, 2], identical=True),
                                             _pair_record("c", [41, 42, 2], [51, 2])])
    data = load_data(_cfg(f"sft.pairs={path}"))
    assert (data.loss, [i.key for i in data.train], data.skipped) == ("dpo", ["a", "c"], 1)
    chosen, rejected = units(_cfg(), None, data, data.train[:1])[0][0]
    assert chosen.model_input.to_ints() == [1, 2, 3, 40] and rejected.model_input.to_ints() == [1, 2, 3, 50]
    assert chosen.loss_fn_inputs["mask"].tolist() == [0, 0, 1, 1] == rejected.loss_fn_inputs["mask"].tolist()
    assert [i.key for i in load_data(_cfg(f"sft.pairs={path}", "sft.max_length=5")).train] == ["a"]  # c: 6 tokens
    # token ids the model's embeddings do not cover: another tokenizer wrote the file
    check_vocabulary(data, units(_cfg(), None, data, data.train)[0], vocab=52)
    with pytest.raises(SFTError, match="sft.pairs: token id 51 is outside the model's vocabulary of 51 tokens"):
        check_vocabulary(data, units(_cfg(), None, data, data.train)[0], vocab=51)
    bad = _write(tmp_path / "bad.jsonl", [kept, {**kept, "chosen": "40 2"}])
    with pytest.raises(RecordFileError, match=rf"^{bad}:2: not a preference pair \(ValueError"):
        load_data(_cfg(f"sft.pairs={bad}"))


class _Client:
    """The learner's forward: fixed sequence log-probabilities per datum, policy and reference."""

    def __init__(self, policy, reference):
        self.rows = {False: policy, True: reference}

    def forward(self, datums, reference=False):
        rows = self.rows[reference][: len(datums)]
        self.rows[reference] = self.rows[reference][len(datums):]
        return [[lp] + [0.0] * (d.length - 1) for lp, d in zip(rows, datums)]


def test_held_out_preference_accuracy_and_loss_by_hand():
    from meshrl.replay.pairs import dpo_datums

    items = [PreferenceItem(str(i), [1], [2, 3], [4, 5]) for i in range(2)]
    datums = dpo_datums(items, 1.0)
    for d in datums:  # the sequence log-probability sits on the first answer token (weight 1)
        d.loss_fn_inputs["mask"] = torch.tensor([1.0, 0.0])
    # pair 0: chosen +1 and rejected -1 against the reference: margin beta * 2 = 0.2 > 0 (right);
    # pair 1: chosen -1, rejected 0: margin -0.1 (wrong)
    client = _Client(policy=[-1.0, -3.0, -3.0, -2.0], reference=[-2.0, -2.0, -2.0, -2.0])
    stats = heldout_preference(client, datums, [-2.0] * 4, beta=0.1, chunk=3)
    assert stats["eval/preference_accuracy"] == 0.5 and stats["eval/n"] == 2
    logsigmoid = torch.nn.functional.logsigmoid
    expected = -(logsigmoid(torch.tensor(0.2)) + logsigmoid(torch.tensor(-0.1))) / 2
    assert stats["eval/dpo_loss"] == pytest.approx(float(expected))
    assert stats["eval/reward_margin"] == pytest.approx(0.05)


def test_the_cli_options_set_the_file_and_a_bad_line_stops_it_before_anything_is_made(tmp_path, capsys):
    from meshrl.cli import main
    from tests.conftest import TINY_RUN

    good = trajectory_record(_multi(), 1, True)
    path = _write(tmp_path / "trajectories.jsonl", [good, {**good, "prompt_tokens": "1 2"}])
    out = tmp_path / "runs"
    assert main(["sft", "--trajectories", path, *TINY_RUN, f"output.dir={out}"]) == 2
    assert capsys.readouterr().err == (f"meshrl: sft: {path}:2: `prompt_tokens` must be a list of token ids, "
                                       "got not a list of non-negative integers\n")
    assert main(["sft", "--pairs", path, "--trajectories", path, *TINY_RUN, f"output.dir={out}"]) == 2
    assert "sft.trajectories and sft.pairs are all set" in capsys.readouterr().err
    assert not out.exists()
    assert main(["sft", "--resume", str(tmp_path), "--pairs", path]) == 2
    assert "give no data file, -c, --eval-file, --trajectories, --pairs" in capsys.readouterr().err
