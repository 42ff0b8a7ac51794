"""One forward/backward for every loss of a step (meshrl.training.shared_pass): distinct sequences
are forwarded once (equal or prefix sequences of different losses share a row), items stay
together, and the gradients equal those of separate passes per loss on seeded data."""

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.policy import PolicyTrainer
from meshrl.training.shared_pass import pack_shared
from meshrl.types import Datum, LossPart

V = 49152


def _tokens(seed, n):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _seq(d):
    return d.model_input.to_ints()


def test_equal_and_prefix_sequences_share_a_row_and_items_stay_together():
    a, b, c = _tokens(1, 12), _tokens(2, 9), _tokens(3, 7)
    pg = [Datum.from_sequence(s, mask=[1.0] * len(s)) for s in (a, b, c)]
    sdpo = [Datum.from_sequence(a, mask=[1.0] * len(a)), Datum.from_sequence(a[:8], mask=[1.0] * 8)]
    pair = [Datum.from_sequence(c[:3] + t, mask=[1.0] * (3 + len(t))) for t in (_tokens(4, 5), _tokens(5, 2))]
    batches = pack_shared([pg, sdpo, pair], [1, 1, 2], size=2)
    rows = [tuple(r.tolist()) for b in batches for r in b.rows]
    assert len(rows) == len(set(rows)) == 5  # a (and its prefix), b, c, and the pair's two answers
    for batch in batches:
        assert len(batch.rows) <= 2 or len(batch.views[2]) == 2  # a pair's rows may exceed the size together
        for view in batch.views:
            for d, r in view:  # every datum reads a row that starts with its own sequence
                assert batch.rows[r][: d.length].tolist() == _seq(d)
    placed = [d for b in batches for view in b.views for d, _ in view]
    assert sorted(map(id, placed)) == sorted(map(id, pg + sdpo + pair))  # each datum once
    [pair_batch] = [b for b in batches if b.views[2]]
    assert [id(d) for d, _ in pair_batch.views[2]] == [id(d) for d in pair]  # chosen then rejected
    [a_batch] = [b for b in batches if any(d is pg[0] for d, _ in b.views[0])]
    assert {r for _, r in a_batch.views[1]} == {r for d, r in a_batch.views[0] if d is pg[0]}


def test_micro_batches_respect_the_size_and_token_caps():
    datums = [Datum.from_sequence(_tokens(s, 6 + s), mask=[1.0] * (6 + s)) for s in range(7)]
    by_size = pack_shared([datums], [1], size=3)
    assert [len(b.rows) for b in by_size] == [3, 3, 1]
    by_tokens = pack_shared([datums], [1], size=16, max_tokens=24)
    assert all(len(b.rows) * max(len(r) for r in b.rows) <= 24 for b in by_tokens)
    with pytest.raises(ValueError, match="3 datums do not form items of 2"):
        pack_shared([datums[:3]], [2], size=4)


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny")


def _trainer(model_path, micro_batch_size):
    cfg = LearnerConfig(lr=1e-2, torch_threads=1, micro_batch_size=micro_batch_size, autocast_bf16=False,
                        release_heap_each_micro_batch=False)
    return PolicyTrainer(model_path, cfg)


def _step_datums():
    """A step's three terms on seeded sequences: policy-gradient datums, SDPO sites on two of
    their trajectories (one the whole trajectory, one an earlier turn: a prefix) and on one
    trajectory of their own, and two DPO pairs (one's rejected answer is a trained trajectory)."""
    g = torch.Generator().manual_seed(7)
    trajectories = [_tokens(10 + i, 14 + 3 * i) for i in range(5)]
    pg = []
    for i, toks in enumerate(trajectories):
        k = 6
        pg.append(Datum.from_sequence(toks, per_sequence={"advantages": 0.4 * (i - 2) + 0.1},
                                      mask=[0.0] * k + [1.0 / (len(toks) - k)] * (len(toks) - k),
                                      logprobs=[0.0] * k + (-torch.rand(len(toks) - k, generator=g) * 5).tolist()))

    def site(toks, start, length, k=4):
        idx = torch.zeros(len(toks), k, dtype=torch.long)
        lp = torch.zeros(len(toks), k)
        idx[start : start + length] = torch.randint(0, V, (length, k), generator=g)
        lp[start : start + length] = torch.log_softmax(torch.randn(length, k, generator=g), -1)
        mask = torch.zeros(len(toks))
        mask[start : start + length] = 1.0 / 11
        return Datum.from_sequence(toks, mask=mask, logprobs=-torch.rand(len(toks), generator=g) * 4,
                                   teacher_topk_indices=idx, teacher_topk_logprobs=lp)

    sdpo = [site(trajectories[1], 8, 5), site(trajectories[3][:15], 9, 6), site(_tokens(99, 16), 10, 4)]
    prompt = trajectories[4][:6]
    pairs = [(prompt, _tokens(60, 5), trajectories[4][6:]), (_tokens(70, 5), _tokens(71, 3), _tokens(72, 6))]
    dpo = [Datum.from_sequence(p + ans, per_sequence={"weight": 0.5}, mask=[0] * len(p) + [1] * len(ans))
           for p, chosen, rejected in pairs for ans in (chosen, rejected)]
    return pg, sdpo, dpo


def _grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("micro_batch_size", [3, 16])
def test_the_shared_pass_gives_the_gradients_of_separate_passes(model_path, micro_batch_size):
    """PG (ppo at the sampling temperature, a step-wide scale), SDPO's JSD and DPO with its
    reference: one shared forward_backward equals a pass per loss (then the PG scale on its own
    gradients, as the step does) to 1e-6 relative, and each loss's metrics are its own."""
    pg, sdpo, dpo = _step_datums()
    rows = [r for b in pack_shared([pg, sdpo, dpo], [1, 1, 2], micro_batch_size) for r in b.rows]
    assert len(rows) == 9  # 12 datums: two SDPO sites and one rejected answer are trained trajectories
    parts = [LossPart(pg, "ppo", {"eps_low": 0.2, "eps_high": 0.28}, 0.7, scale=0.37),
             LossPart(sdpo, "sdpo_jsd", {"beta": 0.5, "temperature": 1.0}, 1.0),
             LossPart(dpo, "dpo", {"beta": 0.1}, 1.0)]
    separate = _trainer(model_path, micro_batch_size)
    expected = [separate.forward_backward(p.datums, p.loss_fn, p.loss_fn_config, temperature=p.temperature)
                for p in parts[:1]]
    separate.scale_grads(parts[0].scale)
    expected += [separate.forward_backward(p.datums, p.loss_fn, p.loss_fn_config, temperature=p.temperature)
                 for p in parts[1:]]
    shared = _trainer(model_path, micro_batch_size)
    got = shared.forward_backward_parts(parts)
    a, b = _grads(separate), _grads(shared)
    assert a.keys() == b.keys() and a
    for name in a:
        assert float((a[name] - b[name]).norm()) <= 1e-6 * float(a[name].norm()) + 1e-12, name
    total_a = torch.cat([g.flatten() for g in a.values()])
    total_b = torch.cat([g.flatten() for g in b.values()])
    assert float((total_a - total_b).norm()) <= 1e-6 * float(total_a.norm())
    for e, o in zip(expected, got):
        assert o.keys() == e.keys()
        for k in e:
            if k not in ("seconds", "pass_share"):
                # abs: DPO's rewards at the initial weights are differences of equal log-prob sums (0 up to
                # float32 rounding, which differs where the passes lay shared prefixes as trees)
                assert o[k] == pytest.approx(e[k], rel=1e-5, abs=1e-6), k
    assert got[2]["num_pairs"] == 2 and got[1]["num_tokens"] == 15
    assert [e["pass_share"] for e in expected] == [1.0, 1.0, 1.0]  # a pass of its own
    # the rows each part adds to those before it: the 5 trajectories (95 input tokens); the SDPO site
    # on a trajectory of its own (15); DPO's answers but the trained one (10 + 7 + 10)
    assert [o["pass_share"] for o in got] == pytest.approx([95 / 137, 15 / 137, 27 / 137])


def test_a_forward_only_pass_gives_the_losses_metrics_and_logprobs_without_gradients(model_path):
    """`backward=False` (the Tinker API's `forward` with a loss, run in the learner): each part's
    loss, metrics and per-datum logprobs equal the training pass's, and no gradient accumulates."""
    pg, sdpo, dpo = _step_datums()
    parts = [LossPart(pg, "ppo", {"eps_low": 0.2, "eps_high": 0.28}, 0.7, scale=0.37),
             LossPart(sdpo, "sdpo_jsd", {"beta": 0.5, "temperature": 1.0}, 1.0), LossPart(dpo, "dpo", {"beta": 0.1})]
    trainer = _trainer(model_path, 4)
    forward_only = trainer.forward_backward_parts(parts, outputs=True, backward=False)
    assert not _grads(trainer)
    trained = trainer.forward_backward_parts(parts, outputs=True)
    assert _grads(trainer)
    for f, t in zip(forward_only, trained):
        assert f.keys() == t.keys()
        for k in f:
            if k == "logprobs":
                for a, b in zip(f[k], t[k]):
                    assert a == pytest.approx(b, abs=1e-6)
            elif k != "seconds":
                assert f[k] == pytest.approx(t[k], rel=1e-6, abs=1e-8), k


def test_one_loss_reads_identical_sequences_once(model_path):
    """Identical datums of one loss share a row: the gradient is still the sum over datums."""
    toks = _tokens(5, 12)
    datums = [Datum.from_sequence(toks, per_sequence={"advantages": a}, mask=[0.0] * 4 + [0.125] * 8,
                                  logprobs=[0.0] * 4 + [-3.0] * 8) for a in (1.0, -0.5, 2.0)]
    assert len(pack_shared([datums], [1], size=8)[0].rows) == 1
    one, three = _trainer(model_path, 8), _trainer(model_path, 8)
    out = three.forward_backward(datums, "importance_sampling")
    one.forward_backward([datums[0]], "importance_sampling")
    one.scale_grads(2.5)  # the advantages sum to 2.5 times the first one
    assert out["num_tokens"] == 24
    for name, g in _grads(one).items():
        torch.testing.assert_close(_grads(three)[name], g, rtol=1e-5, atol=1e-8)


def test_the_client_shares_each_part_out_among_the_learner_ranks():
    """Two learner ranks: every part's datums are split by tokens (a DPO pair kept whole), each rank
    trains its shares of all parts in one call, and each part's result is combined over the ranks
    that trained it; a rank with no datums of any part keeps in step with a padding call."""
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.client import MeshClient
    from meshrl.meshes.supervisor import Supervisor
    from meshrl.testing.fake_meshes import FakeLearner, FakeMeshGroup, Mesh

    cfg = load_config(RunConfig, None, [])
    ranks = [FakeLearner(), FakeLearner()]
    meshes = FakeMeshGroup(learner=Mesh(ranks))
    client = MeshClient(meshes, Supervisor(meshes, cfg.faults), {"learner": 5.0, "sync": 5.0}, 1)
    pg = [Datum.from_sequence(_tokens(s, 6 + s), mask=[1.0] * (6 + s)) for s in range(4)]
    pair = [Datum.from_sequence(_tokens(9, 5), mask=[1.0] * 5), Datum.from_sequence(_tokens(10, 4), mask=[1.0] * 4)]
    results = client.forward_backward_parts([LossPart(pg, "ppo", {}, 0.7, 0.5), LossPart(pair, "dpo", {"beta": 0.1})])
    got = [[c for c in r.calls if c[0] == "fb"] for r in ranks]
    assert sorted(len(c[1]) for calls in got for c in calls if c[2] == "ppo") == [2, 2]
    [dpo_call] = [c for calls in got for c in calls if c[2] == "dpo"]
    assert [id(d) for d in dpo_call[1]] == [id(d) for d in pair]
    assert all(len([c for c in r.calls if c[0] == "parts"]) == 1 for r in ranks)  # one call per rank
    assert [r["tokens"] for r in results] == [sum(5 + s for s in range(4)), 7.0]  # the masked positions
    for r in ranks:  # each part at its own temperature
        fb = [c for c in r.calls if c[0] == "fb"]
        assert [t for _, t in r.temperatures] == [0.7 if c[2] == "ppo" else 1.0 for c in fb]

    idle = [FakeLearner(), FakeLearner()]
    meshes = FakeMeshGroup(learner=Mesh(idle))
    client = MeshClient(meshes, Supervisor(meshes, cfg.faults), {"learner": 5.0, "sync": 5.0}, 1)
    [only] = client.forward_backward_parts([LossPart(pair, "dpo", {"beta": 0.1})])
    assert only["tokens"] == 7.0 and [len(r.calls) for r in idle] == [2, 2]  # the other rank ran a padding call
