"""Inference engines behind the Generator actor: vLLM (in-process) and HF `generate`."""

from meshrl.engines.base import Completion, Engine, SampleRequest, make_engine

__all__ = ["Completion", "Engine", "SampleRequest", "make_engine"]
