"""Inference engines behind the Generator actor: vLLM (in-process) and HF `generate`."""

from meshrl.engines.base import Adapter, Completion, Engine, PromptScores, PromptScoring, SampleRequest, Sampled, make_engine

__all__ = ["Adapter", "Completion", "Engine", "PromptScores", "PromptScoring", "SampleRequest", "Sampled", "make_engine"]
