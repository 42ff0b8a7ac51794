"""Inference engines behind the Generator actor: vLLM (in-process) and HF `generate`."""

from meshrl.engines.base import Completion, Engine, PromptScores, PromptScoring, SampleRequest, Sampled, make_engine

__all__ = ["Completion", "Engine", "PromptScores", "PromptScoring", "SampleRequest", "Sampled", "make_engine"]
