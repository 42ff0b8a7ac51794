"""Channel 2 data preparation on the real SmolLM2 tokenizer: error sites, hint insertion at the
token level, and the JSD mask covering exactly the error-site tokens."""

import pytest
import torch

from meshrl.sdpo.schedule import warmup_weight
from meshrl.sdpo.sites import (FailingTurn, build_error_site, error_kind, failing_turns, insert_hint, render_hint,
                               select_error_sites)
from meshrl.config.sdpo import DEFAULT_HINTS
from meshrl.envs.arithmetic import Problem, grade_integer_answer
from meshrl.renderers import renderer_for_tokenizer
from meshrl.terms.sdpo import site_datum
from meshrl.training.trajectories import Trajectory


@pytest.fixture(scope="module")
def renderer(smollm_tokenizer):
    return renderer_for_tokenizer(smollm_tokenizer)


def _traj(renderer, problem, response, tid="t0", info=None):
    prompt = renderer.build_generation_prompt(list(problem.messages))
    tokens = renderer.encode(response) + renderer.get_stop_sequences()
    reward, graded = grade_integer_answer(response, problem.answer)
    return Trajectory(tid, 0, problem, prompt, tokens, [-1.0] * len(tokens), [1] * len(tokens), 0,
                      response, "stop", reward, info if info is not None else graded)


PROBLEM = Problem("p", ({"role": "user", "content": "What is 12 + 35?"},), "47", {"a": 12, "op": "+", "b": 35})


def test_error_kinds_from_verifier_info():
    assert error_kind(grade_integer_answer("It is 47.", "47")[1]) is None
    assert error_kind(grade_integer_answer("It is 46.", "47")[1]) == "wrong_answer"
    assert error_kind(grade_integer_answer("no idea", "47")[1]) == "wrong_format"
    assert error_kind({"correct": False, "error": "grader raised"}) is None
    assert error_kind({"error_kind": "syntax_error"}) == "syntax_error"


def test_hint_insertion_equals_rendering_the_hinted_conversation(renderer, smollm_tokenizer):
    prompt = renderer.build_generation_prompt(list(PROBLEM.messages))
    hint = "Hint: 46 is not right. The correct answer is 47."
    hinted = insert_hint(renderer, prompt, hint)
    messages = list(PROBLEM.messages) + [{"role": "user", "content": hint}]
    assert hinted == renderer.build_generation_prompt(messages)
    expected = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert smollm_tokenizer.decode(hinted) == expected
    assert hinted[: len(prompt) - 3] == prompt[:-3]  # the student's prefix is reused token for token


def test_hint_insertion_at_a_later_turn_of_a_multi_turn_episode(renderer):
    first = renderer.build_generation_prompt(list(PROBLEM.messages))
    reply = renderer.encode("```python\nprint(1/0)\n```") + renderer.get_stop_sequences()
    observation = {"role": "user", "content": "ZeroDivisionError: division by zero"}
    prefix = first + reply + renderer.bridge(first + reply, [observation])
    hinted = insert_hint(renderer, prefix, "Hint: do not divide by zero.")
    conversation = list(PROBLEM.messages) + [
        {"role": "assistant", "content": "```python\nprint(1/0)\n```"}, observation,
        {"role": "user", "content": "Hint: do not divide by zero."}]
    assert hinted == renderer.build_generation_prompt(conversation)
    with pytest.raises(ValueError, match="generation header"):
        insert_hint(renderer, first + reply, "hint")


def test_error_site_aligns_student_and_teacher_on_the_same_response_tokens(renderer):
    traj = _traj(renderer, PROBLEM, "12 + 35 = 46")
    sites, counts = select_error_sites(renderer, [traj, _traj(renderer, PROBLEM, "47", "t1")], DEFAULT_HINTS, 8, 4)
    assert counts["error_sites"] == 1 and counts["hints"] == 1 and len(sites) == 1
    site = sites[0]
    assert site.hint == "Hint: 46 is not right. The correct answer is 47."
    response = site.student_tokens[site.student_start:]
    assert response == traj.tokens == site.teacher_tokens[site.teacher_start:]
    assert site.length == len(traj.tokens)

    teacher_idx = torch.arange(site.length * 3).reshape(site.length, 3)
    teacher_lp = -teacher_idx.float()
    datum = site_datum(site, teacher_idx, teacher_lp)
    mask = datum.loss_fn_inputs["mask"]
    positions = torch.nonzero(mask).squeeze(-1).tolist()
    assert positions == list(range(site.student_start - 1, site.student_start - 1 + site.length))
    assert mask[mask > 0].tolist() == [1.0] * site.length
    assert datum.loss_fn_inputs["target_tokens"][mask > 0].tolist() == response
    # the teacher's rows sit at exactly the positions that predict the response tokens
    assert torch.equal(datum.loss_fn_inputs["teacher_topk_indices"][mask > 0], teacher_idx)
    assert torch.equal(datum.loss_fn_inputs["teacher_topk_logprobs"][mask > 0], teacher_lp)
    assert datum.loss_fn_inputs["teacher_topk_logprobs"][mask == 0].abs().sum() == 0
    assert datum.loss_fn_inputs["logprobs"][mask > 0].tolist() == [-1.0] * site.length


def _episode(renderer, replies: list[str], errors: list[dict | None]):
    """A multi-turn episode of ``replies`` (feedback turns between them) with per-turn errors."""
    prompt = renderer.build_generation_prompt(list(PROBLEM.messages))
    stop = renderer.get_stop_sequences()
    tokens, mask, turns = [], [], []
    for i, reply in enumerate(replies):
        if i:
            between = renderer.bridge(prompt + tokens, [{"role": "user", "content": f"Tests failed ({i})."}])
            tokens, mask = tokens + between, mask + [0] * len(between)
        start = len(tokens)
        tokens, mask = tokens + renderer.encode(reply) + stop, mask + [1] * (len(renderer.encode(reply)) + len(stop))
        turns.append(([{"role": "user", "content": f"context {i}"}], reply, start, len(tokens)))
    info = {"correct": errors[-1] is None, "turns": turns, "turn_errors": errors}
    logprobs = [-float(i % 7) for i in range(len(tokens))]
    return Trajectory("ep", 0, PROBLEM, prompt, tokens, logprobs, mask, 0, replies[-1], "stop", 0.0, info), prompt


def test_every_failing_turn_of_an_episode_is_an_error_site(renderer):
    fail = {"error_kind": "test_failure", "hint": None, "hint_template_key": None, "tests_passed": 1}
    replies = ["```python\nprint(46)\n```", "```python\nprint(1/0)\n```", "```python\nprint(47)\n```"]
    errors = [fail, {**fail, "error_kind": "runtime_error", "hint": "Hint: do not divide by zero."}, None]
    traj, prompt = _episode(renderer, replies, errors)  # failed twice, then solved the task
    turns = failing_turns(traj, 8)
    assert [(t.start, t.end, t.kind) for t in turns] == [(s, e, k) for (_, _, s, e), k in
                                                        zip(traj.info["turns"][:2], ["test_failure", "runtime_error"])]
    assert failing_turns(traj, 1) == turns[:1]  # the per-episode bound keeps the earliest
    templates = {"test_failure": "Hint: {tests_passed} test passed; the answer is {answer}."}
    sites, counts = select_error_sites(renderer, [traj], templates, 8, 4)
    assert counts["error_sites"] == 2 and counts["hints"] == 2
    assert [s.hint for s in sites] == ["Hint: 1 test passed; the answer is 47.", "Hint: do not divide by zero."]
    for site, (_, _, start, end) in zip(sites, traj.info["turns"]):
        response = traj.tokens[start:end]
        assert site.length == end - start
        assert site.student_tokens == prompt + traj.tokens[:end]  # the student's own history, untouched
        assert site.student_tokens[site.student_start:] == response == site.teacher_tokens[site.teacher_start:]
        assert site.teacher_tokens[:site.teacher_start] == insert_hint(renderer, prompt + traj.tokens[:start], site.hint)
        assert site.sampler_logprobs == traj.logprobs[start:end]
    # the per-step bound
    sites, counts = select_error_sites(renderer, [traj], templates, 1, 4)
    assert len(sites) == 1 and counts["error_sites"] == 2 and counts["hints"] == 1


def test_a_site_must_end_its_prefix_with_the_generation_header(renderer):
    traj, _ = _episode(renderer, ["```python\nprint(46)\n```"], [{"error_kind": "test_failure"}])
    bad = FailingTurn(traj, 2, 5, "test_failure", None, None, None, None, {})
    with pytest.raises(ValueError, match="generation header"):
        build_error_site(renderer, bad, "hint")
    broken = Trajectory("x", 0, PROBLEM, traj.prompt_tokens, traj.tokens, traj.logprobs, traj.mask, 0, "", "stop", 0.0,
                        {**traj.info, "turn_errors": []})
    with pytest.raises(ValueError, match="turn_errors"):
        failing_turns(broken, 4)


def test_alpha_warmup_starts_at_zero_and_then_stays_constant():
    assert [warmup_weight(0.3, 4, s) for s in range(1, 8)] == pytest.approx([0.0, 0.075, 0.15, 0.225, 0.3, 0.3, 0.3])
    assert [warmup_weight(0.1, 0, s) for s in (1, 2, 50)] == [0.1, 0.1, 0.1]
    with pytest.raises(ValueError):
        warmup_weight(0.1, 2, 0)


def test_missing_hint_template_is_counted_not_fatal(renderer):
    traj = _traj(renderer, PROBLEM, "x", info={"correct": False, "error_kind": "tool_not_found"})
    sites, counts = select_error_sites(renderer, [traj], {}, 8, 4)
    assert sites == [] and counts["no_hint_template"] == 1
    assert render_hint({"k": "{a} and {missing}"}, "k", {"a": 1}) == "1 and ?"


def test_step_weights_make_the_loss_alpha_times_the_per_token_mean():
    from meshrl.terms import token_mean_weights
    from meshrl.types import Datum

    datums = [Datum.from_sequence(list(range(8)), mask=[0, 0, 1, 1, 1, 0, 0, 0]),
              Datum.from_sequence(list(range(9)), mask=[0, 1, 1, 1, 1, 1, 0, 0, 0])]
    for d in token_mean_weights(datums, 0.5):  # 3 + 5 site tokens: each weighs alpha / 8
        w = d.loss_fn_inputs["mask"]
        assert w[w != 0].tolist() == pytest.approx([0.5 / 8] * int((w != 0).sum()))
        assert (w == 0).sum() == d.length - int((w != 0).sum())
