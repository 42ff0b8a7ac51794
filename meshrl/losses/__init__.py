"""Token-level, sum-reduced losses for RL post-training (pure functions on tensors).

Every loss returns :class:`LossOutput` (``.loss`` scalar tensor, ``.metrics`` dict of floats).
Normalisation is the caller's job; :mod:`meshrl.losses.aggregation` provides global-count weights.
Importing this package imports every module in it, which registers the learner's losses
(:mod:`meshrl.losses.registry`): a new loss is one new module here with a `@register_loss` function.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from meshrl.losses.aggregation import Aggregation, GlobalCounts, aggregation_weights, global_scale, local_weights
from meshrl.losses.base import LossOutput
from meshrl.losses.distill import IGNORE_INDEX, generalized_jsd, generalized_jsd_topk, jsd_per_token
from meshrl.losses.offpolicy import dro, gspo
from meshrl.losses.preference import dpo, sequence_logprobs
from meshrl.losses.registry import LOSSES, ForwardPass, LossSpec, get_loss, register_loss
from meshrl.losses.token_losses import cispo, cross_entropy, importance_sampling, ppo

__all__ = [
    "Aggregation",
    "ForwardPass",
    "LOSSES",
    "LossSpec",
    "GlobalCounts",
    "IGNORE_INDEX",
    "LossOutput",
    "aggregation_weights",
    "cispo",
    "cross_entropy",
    "dpo",
    "dro",
    "generalized_jsd",
    "generalized_jsd_topk",
    "global_scale",
    "get_loss",
    "gspo",
    "importance_sampling",
    "jsd_per_token",
    "local_weights",
    "ppo",
    "register_loss",
    "sequence_logprobs",
]

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
