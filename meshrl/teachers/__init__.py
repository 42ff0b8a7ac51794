"""External teachers over OpenAI-compatible HTTP: the async client with retries and a spend
budget, action canonicalisers, k-of-N agreement, channel-3 trace replay into DPO pairs, and the
optional LLM hint generator."""

from meshrl.teachers.agreement import PairDecision, PreferencePair, TeacherAnswer, decide_pair
from meshrl.teachers.canonical import canonicalise
from meshrl.teachers.client import SpendMeter, TeacherClient, TeacherError, TeacherReply
from meshrl.teachers.config import HintGeneratorConfig, ReplayConfig, TeacherEndpointConfig
from meshrl.teachers.hints import LLMHintGenerator
from meshrl.teachers.replay import ReplayPair, ReplayResult, Trace, TraceStep, replay_trace, teacher_clients

__all__ = [
    "HintGeneratorConfig",
    "LLMHintGenerator",
    "PairDecision",
    "PreferencePair",
    "ReplayConfig",
    "ReplayPair",
    "ReplayResult",
    "SpendMeter",
    "TeacherAnswer",
    "TeacherClient",
    "TeacherEndpointConfig",
    "TeacherError",
    "TeacherReply",
    "Trace",
    "TraceStep",
    "canonicalise",
    "decide_pair",
    "replay_trace",
    "teacher_clients",
]
