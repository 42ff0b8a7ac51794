"""A prompt's scores from its next-token logprobs (meshrl.engines.prompt_scores), against values
computed by hand on a 2-position, 4-token distribution."""

import math

import pytest
import torch

from meshrl.engines.base import PromptScoring
from meshrl.engines.prompt_scores import draw_alternatives, prompt_scores

# row i: log p(. | prompt[:i + 1]) over a vocabulary of 4
P = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.6, 0.2, 0.15, 0.05]])
LOGPROBS = P.log()
PROMPT = [0, 3, 1]  # own tokens at rows 0 and 1: 3 then 1


def test_own_topk_and_target_logprobs():
    scores = prompt_scores(LOGPROBS, PROMPT, PromptScoring(logprobs=True, topk=2, targets=((2, -1), (0, 3))))
    assert scores.logprobs == pytest.approx([math.log(0.4), math.log(0.2)])
    assert scores.topk[0] == [[3, 2], [0, 1]]
    assert scores.topk[1][0] == pytest.approx([math.log(0.4), math.log(0.3)])
    assert scores.topk[1][1] == pytest.approx([math.log(0.6), math.log(0.2)])
    assert scores.targets[0] == pytest.approx([math.log(0.3), 0.0])
    assert scores.targets[1] == pytest.approx([math.log(0.6), math.log(0.05)])
    assert scores.alt is None


def test_draws_follow_the_temperature_and_the_seed():
    greedy = draw_alternatives(LOGPROBS, 3, 0.0, None)
    assert greedy.tolist() == [[3, 3, 3], [0, 0, 0]]
    a, b = draw_alternatives(LOGPROBS, 5, 1.0, 7), draw_alternatives(LOGPROBS, 5, 1.0, 7)
    assert torch.equal(a, b) and a.shape == (2, 5)
    # frequencies at temperature 1 are p; at temperature 0.25 they are p^4 normalised
    many = draw_alternatives(LOGPROBS, 20000, 1.0, 1)
    assert (many[0] == 3).float().mean().item() == pytest.approx(0.4, abs=0.02)
    cold = draw_alternatives(LOGPROBS, 20000, 0.25, 2)
    sharp = P[1] ** 4 / (P[1] ** 4).sum()
    assert (cold[1] == 0).float().mean().item() == pytest.approx(sharp[0].item(), abs=0.01)
    scores = prompt_scores(LOGPROBS, PROMPT, PromptScoring(alt_k=2, alt_temperature=1.0, alt_seed=7))
    ids = torch.tensor(scores.alt[0])
    assert ids.tolist() == draw_alternatives(LOGPROBS, 2, 1.0, 7).tolist()
    assert torch.allclose(torch.tensor(scores.alt[1]), LOGPROBS.gather(1, ids))  # logprobs at temperature 1


def test_shapes_that_do_not_fit_the_prompt_are_refused():
    with pytest.raises(ValueError, match="2 rows of logprobs for a prompt of 4 tokens"):
        prompt_scores(LOGPROBS, [0, 1, 2, 3], PromptScoring(logprobs=True))
    with pytest.raises(ValueError, match="targets have 1 rows, expected 2"):
        prompt_scores(LOGPROBS, PROMPT, PromptScoring(targets=((1,),)))
