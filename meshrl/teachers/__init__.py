"""External teachers over OpenAI-compatible HTTP: the async client with retries, timeouts, a spend
budget and key redaction, and `meshrl teachers serve` (a local vLLM teacher). The channels that use
them live in their own folders: trace replay in `meshrl.replay`, LLM hints in `meshrl.sdpo`."""

from meshrl.teachers.client import SpendMeter, TeacherClient, TeacherError, TeacherReply

__all__ = ["SpendMeter", "TeacherClient", "TeacherError", "TeacherReply"]
