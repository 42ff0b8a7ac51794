"""Loss terms as plug-ins: which terms a config builds, one-line errors for a loss or term the
registries do not know, and a loss, a policy-gradient loss and a term registered from outside the
package (tests/plugins/likelihood_term.py) that a run selects through its config alone: over fake
meshes, and with real Monarch processes and the tiny model."""

from pathlib import Path

import pytest

from meshrl.config.base import ConfigError, load_config
from meshrl.config.run import RunConfig
from meshrl.terms import check_config, term_classes
from meshrl.testing.fake_meshes import make_loop

PLUGIN = str(Path(__file__).resolve().parent / "plugins" / "likelihood_term.py")
TEACHERS = "replay.teachers.teachers=[{name: a, base_url: 'http://127.0.0.1:9/v1', model: a}, " \
           "{name: b, base_url: 'http://127.0.0.1:9/v1', model: b}]"


def _names(*overrides):
    cfg = load_config(RunConfig, None, list(overrides))
    check_config(cfg)
    return [cls.__name__ for cls in term_classes(cfg)]


def test_the_config_chooses_the_terms():
    assert _names() == ["PolicyGradientTerm"]
    assert _names("sdpo.alpha=0.1") == ["PolicyGradientTerm", "SDPOTerm"]
    assert _names("sdpo.alpha=0.1", "replay.beta=0.2", TEACHERS) == ["PolicyGradientTerm", "SDPOTerm", "ReplayTerm"]
    shards = "diloco.store_url=file:///tmp/unused"
    # a learner of shards trains the DPO term on the pairs in the shards; a generation job trains nothing
    assert _names("replay.beta=0.2", "diloco.role=learn", shards) == ["PolicyGradientTerm", "ShardPairsTerm"]
    assert _names("replay.beta=0.2", "diloco.role=generate", shards, TEACHERS) == ["ReplayTerm"]
    assert _names(f"plugins=[{PLUGIN}]", "trainer.terms=[{name: reply_likelihood}]") == [
        "PolicyGradientTerm", "ReplyLikelihood"]


@pytest.mark.parametrize("overrides, message", [
    (["trainer.loss.name=ppoo"], "trainer.loss.name = 'ppoo': not a registered loss; expected a policy_gradient "
                                 "loss: ["),
    (["trainer.loss.name=dpo"], "trainer.loss.name = 'dpo': a preference loss; expected a policy_gradient loss"),
    (["trainer.loss.params={eps_hi: 0.3}"], "trainer.loss.params: loss 'ppo': unknown key 'eps_hi'"),
    (["trainer.loss.params={eps_low: 2}"], "trainer.loss.params: loss 'ppo': eps_low = 2 (int): expected less than 1"),
    (["trainer.terms=[{name: nope}]"], "trainer.terms.0.name = 'nope': not a registered loss term"),
    ([f"plugins=[{PLUGIN}]", "trainer.terms=[{name: reply_likelihood, params: {max_datum: 2}}]"],
     "trainer.terms.0.params: unknown key 'max_datum'"),
    (["plugins=[no_such_module_here]"], "plugins: cannot import 'no_such_module_here': ModuleNotFoundError"),
    (["plugins=[/nowhere/plugin.py]"], "plugins: no file /nowhere/plugin.py"),
])
def test_a_loss_or_term_the_registries_do_not_know_is_a_one_line_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(load_config(RunConfig, None, overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_loss_parameters_of_the_config_reach_the_learner():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 2, "trainer.group_size": 4,
                                    "trainer.loss.params": "{eps_high: 0.28}"})
    loop.step()
    loop.close()
    [(kind, _, loss_fn, config)] = [c for c in learner.calls if c[0] == "fb"]
    assert (loss_fn, config) == ("ppo", {"eps_low": 0.2, "eps_high": 0.28})


def test_a_plugin_loss_and_term_train_through_the_config_over_fake_meshes():
    loop, _, learner = make_loop(**{
        "trainer.prompts_per_step": 2, "trainer.group_size": 4, "plugins": f"[{PLUGIN}]",
        "trainer.loss.name": "capped_importance_sampling", "trainer.loss.params": "{cap: 1.5}",
        "trainer.terms": "[{name: reply_likelihood, weight: 0.1, params: {max_datums: 3}}]"})
    metrics, trajectories = loop.step()
    loop.close()
    # one shared pass for both terms, the policy gradient at the step-wide normaliser (1 / tokens)
    assert [c[0] for c in learner.calls] == ["parts", "fb", "fb", "opt"]
    [(pg_loss, scale), (term_loss, term_scale)] = learner.calls[0][1]
    assert (pg_loss, term_loss, term_scale) == ("capped_importance_sampling", "reply_likelihood", 1.0)
    assert scale == pytest.approx(1 / metrics["batch/tokens_total"])
    pg, term = learner.calls[1], learner.calls[2]
    assert (pg[2], pg[3]) == ("capped_importance_sampling", {"cap": 1.5})
    assert (term[2], term[3]) == ("reply_likelihood", {})
    # the term's datums: at most 3 replies a unit with reward > 0, each reply token weighted
    # weight / (reply tokens of the step): the loss is 0.1 x the per-token mean
    datums = term[1]
    assert 0 < len(datums) <= 3
    tokens = sum(int((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums)
    for d in datums:
        weights = d.loss_fn_inputs["mask"]
        assert weights[weights != 0].tolist() == pytest.approx([0.1 / tokens] * int((weights != 0).sum()))
    assert "loss/reply_likelihood" in metrics and "timing/likelihood_s" in metrics


@pytest.mark.monarch
def test_a_loss_and_a_term_of_your_own_train_from_the_config_alone(tiny_run_config, tiny_session):
    """Real learner and generator processes: the learner imports the plugin file named in the config
    and trains the run's policy-gradient loss and extra term from it (their metrics come back from
    the learner process)."""
    from meshrl.controller.train import make_run_dir, run_training
    from meshrl.metrics.records import read_metrics

    cfg = tiny_run_config(
        "output.name=plugin", "trainer.steps=2", "trainer.eval.every=0", "trainer.eval.at_start=false",
        "trainer.checkpoint.export_final=false", f"plugins=[{PLUGIN}]", "trainer.loss.name=capped_importance_sampling",
        "trainer.loss.params={cap: 1.5}", "trainer.terms=[{name: reply_likelihood, weight: 0.1}]")
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir, session=tiny_session)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 2
    assert all("train/capped_fraction" in r for r in train)  # the plugin's policy-gradient loss ran
    assert all(r["likelihood/reply_tokens"] > 0 and r["loss/reply_likelihood"] > 0 for r in train)
    for r in train:
        assert r["loss/total"] == pytest.approx(r["loss/grpo"] + 0.1 * r["loss/reply_likelihood"])


@pytest.mark.parametrize("temperature, scored_at", [(0.7, 0.7), (0.0, 1.0)])
def test_the_learner_scores_sampled_datums_at_the_sampling_temperature(temperature, scored_at):
    """The policy-gradient term (its loss and KL shaping's reference logprobs) and a term of
    sampled datums ask the learner for log-probabilities at the rollouts' temperature (greedy: 1,
    as the engines record them), so on-policy ratios are 1."""
    loop, _, learner = make_loop(**{
        "trainer.prompts_per_step": 2, "trainer.group_size": 4, "generator.sampling.temperature": temperature,
        "trainer.advantage.kl_coef": 0.1, "plugins": f"[{PLUGIN}]",
        "trainer.terms": "[{name: reply_likelihood, weight: 0.1}]"})
    loop.step()
    loop.close()
    assert learner.temperatures == [("forward", scored_at), ("fb", scored_at), ("fb", scored_at)]


def test_training_refuses_nucleus_sampling_in_one_line_and_evaluation_allows_it():
    cfg = load_config(RunConfig, None, ["generator.sampling.top_p=0.9"])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert "generator.sampling.top_p = 0.9: training needs 1.0" in str(err.value) and "\n" not in str(err.value)
    check_config(cfg, trains=False)


def test_a_term_that_trains_itself_in_finish_still_counts():
    """A term of your own whose `finish` makes its own learner call and returns its weighted loss
    (rather than handing a part to the shared pass) is reported and summed like the others."""
    from meshrl.terms import LossTerm, TermContext
    from meshrl.terms.base import finish_terms
    from meshrl.types import Datum

    class Client:
        def __init__(self):
            self.calls = []

        def forward_backward(self, datums, loss_fn, config, temperature=1.0):
            self.calls.append(("fb", loss_fn))
            return {"loss": 0.25}

        def forward_backward_parts(self, parts):
            self.calls.append(("parts", [p.loss_fn for p in parts]))
            return [{"loss": 0.5, "tokens": 3.0} for _ in parts]

    class OwnPass(LossTerm):
        name, prefix, loss = "own", "own", "cross_entropy"

        def finish(self, version, metrics):
            return self.client.forward_backward([], self.loss, {})["loss"]

    class Handed(LossTerm):
        name, prefix, loss = "handed", "handed", "cross_entropy"

        def finish(self, version, metrics):
            return self.part([Datum.from_sequence([1, 2, 3], weights=[0, 1, 1])])

    class Empty(LossTerm):
        name, prefix, loss = "empty", "empty", "cross_entropy"

        def finish(self, version, metrics):
            return self.part([])

    cfg = load_config(RunConfig, None, [])
    client = Client()
    ctx = TermContext(cfg, client, None)
    metrics = {}
    losses = finish_terms([OwnPass(ctx), Handed(ctx), Empty(ctx), LossTerm(ctx)], 1, metrics, client)
    assert losses == {"own": 0.25, "handed": 0.5, "empty": 0.0}  # a term that trains nothing is absent
    assert client.calls == [("fb", "cross_entropy"), ("parts", ["cross_entropy"])]
    assert metrics == {"handed/tokens": 3.0}
