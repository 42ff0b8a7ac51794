"""Scoring continuations of shared contexts with each shared prefix forwarded once
(meshrl.training.prefix_scoring): the groups, the values (those of whole forwards), the tokens the
decoder runs, and the learner's SDPO teacher call on it."""

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.policy import PolicyTrainer
from meshrl.training.prefix_scoring import topk_at_positions
from meshrl.training.prefix_trees import PrefixGroup, common_prefix, prefix_groups
from meshrl.types import Datum

V = 49152


def _tokens(seed, n):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_common_prefix_counts_the_leading_tokens_two_sequences_share():
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([7], [8]) == 0


def test_groups_share_the_longest_worthwhile_prefix_and_stop_before_the_first_scored_position():
    p, q = [5] * 20, [6] * 30
    seqs = [p + [1, 1, 1], q + [2, 2], p + [3, 3], [9] * 10, p + [4], q + [1]]
    first = [22, 31, 21, 5, 20, 25]  # the last of q's has its first scored position at 25: its group's prefix stops there
    groups = prefix_groups(seqs, first, min_prefix=16)
    assert PrefixGroup(20, [0, 2, 4]) in groups  # sorted order: p+[1..], p+[3..], p+[4]
    assert PrefixGroup(25, [5, 1]) in groups
    assert groups[-1] == PrefixGroup(0, [3])  # no partner: forwarded whole
    assert prefix_groups(seqs, first, min_prefix=26) == [PrefixGroup(0, [3, 4, 2, 0, 5, 1])]  # by length
    # a neighbour that shares little does not cut a long shared prefix down: 2 x 40 saved beats 3 x 4
    long = [[8] * 40 + [i] for i in range(3)] + [[8] * 4 + [0] * 40]
    grouped = prefix_groups(long, [40, 40, 40, 43], min_prefix=2)
    assert PrefixGroup(40, [0, 1, 2]) in grouped and PrefixGroup(0, [3]) in grouped


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()


def _sites():
    """Two prompts' hinted contexts (each prompt's five samples share it) and one alone."""
    seqs, starts, lengths = [], [], []
    for p, prompt in enumerate([_tokens(1, 40), _tokens(2, 35)]):
        for j in range(5):
            hint, response = _tokens(10 * p + j + 3, 10 + j), _tokens(10 * p + j + 50, 8 + 3 * j)
            seqs.append(prompt + hint + response)
            starts.append(len(prompt) + len(hint))
            lengths.append(len(response))
    seqs.append(_tokens(99, 30))
    starts.append(20)
    lengths.append(10)
    return seqs, starts, lengths


def _whole(model, seqs, starts, lengths, k):
    out = []
    with torch.no_grad():
        for s, start, n in zip(seqs, starts, lengths):
            logp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0, start - 1 : start - 1 + n].float(), -1)
            values, indices = logp.topk(k, -1)
            out.append((indices, values, logp.gather(-1, torch.tensor(s[start : start + n])[:, None]).squeeze(-1)))
    return out


def test_shared_prefixes_give_the_values_of_whole_forwards_and_forward_fewer_tokens(model):
    seqs, starts, lengths = _sites()
    whole = _whole(model, seqs, starts, lengths, 8)
    forwarded, totals = [], {}
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: forwarded.append(args[0].numel()))
    try:
        for min_prefix in (0, 16):
            forwarded.clear()
            got = topk_at_positions(model, seqs, starts, lengths, 8, pad_id=0, max_rows=3, min_prefix=min_prefix,
                                    device=torch.device("cpu"))
            for (idx, lp, own), (ref_idx, ref_lp, ref_own) in zip(got, whole):
                assert torch.equal(idx.long(), ref_idx) and idx.dtype == torch.int32
                torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
                torch.testing.assert_close(own, ref_own, rtol=0, atol=1e-5)
            groups = prefix_groups(seqs, [s - 1 for s in starts], min_prefix)
            if min_prefix:  # each prompt once, its samples' rest on top of it; the lone one whole
                assert sorted((g.prefix, sorted(g.members)) for g in groups) == [(0, [10]), (35, [5, 6, 7, 8, 9]),
                                                                                (40, [0, 1, 2, 3, 4])]
            else:
                assert [(g.prefix, len(g.members)) for g in groups] == [(0, 11)]
            shared = [g for g in groups if g.prefix]
            rests = sorted(len(seqs[i]) - g.prefix for g in shared for i in g.members)
            lone = sorted(len(seqs[i]) for g in groups if not g.prefix for i in g.members)
            # the prefixes together, padded to the longest; then the rests, then the lone, in chunks of 3 rows
            expected = len(shared) * max((g.prefix for g in shared), default=0)
            for widths in (rests, lone):
                expected += sum(len(widths[i : i + 3]) * widths[i : i + 3][-1] for i in range(0, len(widths), 3))
            assert sum(forwarded) == expected
            totals[min_prefix] = expected
    finally:
        hook.remove()
    assert totals[16] < 0.7 * totals[0]
    full = topk_at_positions(model, seqs[:2], starts[:2], lengths[:2], 0, pad_id=0, max_rows=4, min_prefix=16,
                             device=torch.device("cpu"))
    assert full[0][0] is None and full[0][1].shape == (lengths[0], model.config.vocab_size)


def test_a_span_outside_its_sequence_is_refused(model):
    with pytest.raises(ValueError, match="every scored span needs a token before it"):
        topk_at_positions(model, [[1, 2, 3]], [0], [2], 4, pad_id=0, max_rows=2, min_prefix=0,
                          device=torch.device("cpu"))
    with pytest.raises(ValueError, match="every scored span"):
        topk_at_positions(model, [[1, 2, 3]], [2], [2], 4, pad_id=0, max_rows=2, min_prefix=0,
                          device=torch.device("cpu"))


def test_the_learner_scores_shared_prefixes_once_with_the_values_of_its_micro_batches():
    """`PolicyTrainer.topk_logprobs` (SDPO's teacher in the learner) shares the prompts of one
    group's sites; its values equal the micro-batched path's (FSDP2's), in bf16 autocast too."""
    from meshrl.sdpo.sites import ErrorSite
    from meshrl.terms.sdpo import teacher_datum

    seqs, starts, lengths = _sites()
    sites = [ErrorSite(f"t{i}", "wrong_answer", "hint", [], 0, s, start, n, [])
             for i, (s, start, n) in enumerate(zip(seqs, starts, lengths))]
    datums = [teacher_datum(s) for s in sites]
    for bf16, atol in ((False, 1e-5), (True, 0.1)):
        trainer = PolicyTrainer(resolve_model("tiny"), LearnerConfig(torch_threads=1, micro_batch_size=4,
                                                                       autocast_bf16=bf16))
        shared = trainer.topk_logprobs(datums, 6, min_prefix=16)
        whole = trainer._topk_in_micro_batches(datums, 6, padding=False, min_prefix=0)
        for a, b in zip(shared, whole):
            torch.testing.assert_close(a[1], b[1], rtol=0, atol=atol)
            torch.testing.assert_close(a[2], b[2], rtol=0, atol=atol)
            if not bf16:
                assert torch.equal(a[0], b[0])
    bad = Datum(datums[0].model_input, {**datums[0].loss_fn_inputs,
                                        "target_tokens": torch.zeros_like(datums[0].loss_fn_inputs["target_tokens"])})
    with pytest.raises(ValueError, match="targets must be its model input shifted by one"):
        trainer.topk_logprobs([bad], 6)
    gap = teacher_datum(sites[0])
    gap.loss_fn_inputs["mask"][-3] = 0.0
    with pytest.raises(ValueError, match="mask must be one run of positions"):
        trainer.topk_logprobs([gap], 6)
