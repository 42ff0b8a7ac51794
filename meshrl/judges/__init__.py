"""LLM judges: rewards from an OpenAI-compatible model that grades an episode against a rubric
(`Judge`), with the prompt building and score parsing they use (`meshrl.judges.rubric`)."""

from meshrl.judges.judge import Judge, JudgeResult
from meshrl.judges.rubric import mix

__all__ = ["Judge", "JudgeResult", "mix"]
