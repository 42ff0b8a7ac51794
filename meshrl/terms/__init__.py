"""Loss terms, the plug-ins of the GRPO loop: the policy-gradient term, SDPO (channel 2), trace-replay
DPO (channel 3), and terms of your own (`register_term`, named in `trainer.terms`)."""

from meshrl.terms.base import DatumTerm, LossTerm, StepOutput, TermContext, finish_terms, token_mean_weights
from meshrl.terms.registry import TERMS, build_terms, check_config, register_term, term_classes

__all__ = ["DatumTerm", "LossTerm", "StepOutput", "TERMS", "TermContext", "build_terms", "check_config",
           "finish_terms", "register_term", "term_classes", "token_mean_weights"]
