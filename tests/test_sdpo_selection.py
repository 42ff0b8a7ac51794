"""Which scored SDPO sites a step trains, and how many (meshrl.sdpo.selection): the sites where
the hinted teacher and the student disagree most, within a budget that follows the channel's
measured cost; and the SDPO term applying both."""

import types

import pytest
import torch

import meshrl.terms.sdpo as sdpo_term
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.sdpo.selection import ScoredSite, candidates, disagreement, most_informative, next_budget
from meshrl.sdpo.sites import ErrorSite
from meshrl.terms.base import StepOutput, TermContext


def test_disagreement_is_the_mean_of_the_students_log_probs_minus_the_teachers():
    assert disagreement([-0.5, -1.0], torch.tensor([-2.0, -1.5])) == pytest.approx(1.0)
    assert disagreement([-3.0], torch.tensor([-1.0])) == pytest.approx(-2.0)  # the hinted teacher likes it more
    with pytest.raises(ValueError, match="2 sampler log-probs for 3 teacher ones"):
        disagreement([-1.0, -1.0], torch.tensor([-1.0, -1.0, -1.0]))


def _scored(values):
    return [ScoredSite(None, None, torch.zeros(1, 1), v) for v in values]


def test_the_most_informative_are_kept_in_the_order_they_were_found():
    scored = _scored([0.1, 2.0, -1.0, 2.0, 0.5])
    kept, dropped = most_informative(scored, 3)
    assert kept == [scored[1], scored[3], scored[4]] and dropped == [scored[0], scored[2]]
    assert most_informative(scored, 0) == ([], scored)
    assert most_informative(scored, -2) == ([], scored)
    assert most_informative(scored, 9) == (scored, [])
    tie, _ = most_informative(_scored([1.0, 1.0, 1.0]), 2)
    assert [s.disagreement for s in tie] == [1.0, 1.0] and len(tie) == 2


def test_the_budget_is_the_share_of_the_rest_of_the_step_at_the_measured_cost_per_site():
    # 8 sites cost 4 s of a 20 s step: 0.5 s a site; a quarter of the other 16 s buys 8 sites
    assert next_budget(0.25, 20.0, 4.0, 8, most=16) == 8
    assert next_budget(0.2, 20.0, 4.0, 8, most=16) == 6  # 6.4, rounded down
    assert next_budget(1.0, 20.0, 4.0, 8, most=16) == 16  # no more than the ceiling
    assert next_budget(0.01, 20.0, 4.0, 8, most=16) == 1  # never none: the cost must stay measurable
    assert next_budget(0.5, 3.0, 4.0, 8, most=16) == 1  # a step the channel filled
    with pytest.raises(ValueError, match="trained sites at a cost"):
        next_budget(0.2, 20.0, 0.0, 8, most=16)
    assert candidates(5, 1.5) == 8 and candidates(4, 1.0) == 4


class _Learner:
    """The learner's `topk_logprobs` as the SDPO term calls it: each site's own tokens get the
    log-probs the test chose; the call takes a second of a fake clock."""

    def __init__(self, clock, own):
        self.clock, self.own, self.calls = clock, own, []

    def topk_logprobs(self, datums, k, min_prefix):
        self.calls.append((len(datums), k, min_prefix))
        self.clock[0] += 1.0
        out = []
        for d in datums:
            n = int((d.loss_fn_inputs["mask"] != 0).sum())
            target = int(d.loss_fn_inputs["target_tokens"][-1])
            out.append((torch.zeros(n, k, dtype=torch.int32), torch.full((n, k), -1.0), self.own[target]))
        return out


def _site(i, n=3):
    """Site ``i``: its tokens end with ``i`` (the fake learner's key), sampler log-probs -1."""
    tokens = [7, 8, 9] + [50 + i] * (n - 1) + [i]
    return ErrorSite(f"t{i}", "wrong_answer", "hint", tokens, 3, tokens, 3, n, [-1.0] * n)


def test_the_term_trains_the_sites_the_teacher_disagrees_with_most_and_adapts_its_budget(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(sdpo_term, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = load_config(RunConfig, None, ["sdpo.alpha=0.5", "sdpo.teacher=learner", "sdpo.max_sites_per_step=4",
                                        "sdpo.candidates_per_site=2", "sdpo.cost_share=0.1", "sdpo.min_shared_prefix=8"])
    own = {i: torch.full((3,), v) for i, v in enumerate([-1.0, -4.0, -0.5, -3.0, -2.0, -6.0])}  # disagreement 0, 3, ...
    learner = _Learner(clock, own)
    term = sdpo_term.SDPOTerm(TermContext(cfg, learner, renderer=None))
    term.start_step(1)
    term.gathered = [_site(i) for i in range(6)]
    metrics = {}
    part = term.finish(1, metrics)
    assert learner.calls == [(6, 32, 8)]  # every candidate scored, shared prefixes of 8 tokens or more once
    kept = [int(d.loss_fn_inputs["target_tokens"][-1]) for d in part.datums]
    assert kept == [1, 3, 4, 5]  # the four of largest disagreement (3, 2, 1, 5 nats), in the order found
    assert metrics["sdpo/scored_sites"] == 6 and metrics["sdpo/trained_sites"] == 4
    assert metrics["sdpo/disagreement_kept"] == pytest.approx((3 + 2 + 1 + 5) / 4)
    assert metrics["sdpo/disagreement_dropped"] == pytest.approx((0 - 0.5) / 2)
    assert metrics["timing/sdpo_teacher_s"] == 1.0
    term.trained(part, {"loss": 0.3, "seconds": 4.0, "pass_share": 0.25, "tokens": 12.0}, metrics)
    # a second optimizer step in the same step has no budget left: its sites are neither scored nor trained
    term.gathered = [_site(2)]
    assert term.finish(1, {}).datums == [] and len(learner.calls) == 1
    clock[0] = 21.0  # the step: 21 s; the channel: 1 s of teacher, a quarter of a 4 s pass: 2 s for 4 sites
    term.end_step(StepOutput(1, 1, []), metrics)
    assert metrics["sdpo/cost_s"] == pytest.approx(2.0) and metrics["sdpo/site_budget"] == 4
    assert term.budget == 3  # 0.1 x 19 s / 0.5 s a site = 3.8
    assert term.load_state_dict(term.state_dict()) is None and term.budget == 3
    term.start_step(2)
    term.gathered = [_site(i) for i in range(4)]
    assert [int(d.loss_fn_inputs["target_tokens"][-1]) for d in term.finish(2, {}).datums] == [0, 1, 3]
    fresh = sdpo_term.SDPOTerm(TermContext(cfg, learner, renderer=None))
    fresh.load_state_dict({"counts": {}, "budget": 2})
    assert fresh.budget == 2


def test_without_a_cost_share_the_budget_stays_the_ceiling(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(sdpo_term, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = load_config(RunConfig, None, ["sdpo.alpha=0.5", "sdpo.max_sites_per_step=3"])
    term = sdpo_term.SDPOTerm(TermContext(cfg, _Learner(clock, {i: torch.full((3,), -1.0) for i in range(3)}), None))
    term.start_step(1)
    term.gathered = [_site(i) for i in range(3)]
    part = term.finish(1, {})
    assert len(part.datums) == 3
    term.trained(part, {"loss": 0.3, "seconds": 4.0, "pass_share": 0.9, "tokens": 12.0}, {})
    clock[0] = 100.0
    term.end_step(StepOutput(1, 1, []), {})
    assert term.budget == 3
