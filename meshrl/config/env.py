"""Configuration of the code sandbox and the multi-turn code-execution environment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshrl.config.base import Section


class SandboxConfig(Section):
    """Where and how untrusted code runs: isolation layer, resource limits, output caps."""

    layer: Literal["auto", "bwrap", "rlimit"] = "auto"
    """Isolation layer. `auto` uses bubblewrap (namespaces + read-only root) when it works on this
    machine and falls back to `rlimit` (plain subprocess + rlimits + scrubbed env + temp dir)
    otherwise; `bwrap` fails instead of falling back."""

    python: str = "auto"
    """Interpreter run inside the sandbox. `auto` takes the first of /usr/bin/python3,
    /usr/local/bin/python3 and the current interpreter that starts in the chosen layer. Test code
    needs only the standard library."""

    bwrap_path: str = "bwrap"
    """bubblewrap binary (name looked up on PATH, or an absolute path)."""

    timeout_s: float = Field(10.0, gt=0)
    """Default wall-clock limit of one execution when the caller gives none; the whole process
    tree is killed when it expires."""

    memory_mb: int = Field(512, ge=64)
    """RLIMIT_AS of the sandboxed process, in MiB (address space, so allocations fail with
    MemoryError well before the host runs short)."""

    max_processes: int = Field(32, ge=4)
    """RLIMIT_NPROC inside the sandbox (the fork-bomb ceiling). Counted per sandbox: inside its own
    user namespace on the bwrap layer, per sandbox uid when running as root."""

    nice: int = Field(10, ge=0, le=19)
    """Niceness added to sandboxed processes, so code under test yields the CPU to the generator
    and learner running beside it."""

    max_file_mb: int = Field(16, ge=1)
    """RLIMIT_FSIZE: the largest file the sandboxed code may write, in MiB."""

    max_open_files: int = Field(64, ge=16)
    """RLIMIT_NOFILE: open file descriptors inside the sandbox."""

    workdir_mb: int = Field(32, ge=1)
    """Size of the private writable work directory (a tmpfs on the bwrap layer), in MiB."""

    tmp_mb: int = Field(16, ge=1)
    """Size of the private /tmp (a tmpfs on the bwrap layer), in MiB."""

    max_output_bytes: int = Field(65536, ge=1024)
    """Captured bytes of stdout and of stderr each; the rest is dropped and `truncated` is set."""

    kill_on_output_limit: bool = True
    """Kill the execution as soon as its output passes `max_output_bytes` (error_kind
    `output_limit`) instead of draining it until it exits or times out."""

    max_parallel: int = Field(16, ge=1, le=256)
    """Executions that may run at once in one Sandbox; further calls wait for a free slot."""

    sandbox_uid_base: int = Field(200000, ge=1000)
    """When the host process is root, every execution runs as its own unprivileged uid/gid (no
    supplementary groups), leased from `sandbox_uid_base` .. `sandbox_uid_base + 1023` exclusively
    across all processes of the host: process limits then apply per execution, and every leftover
    process of the uid can be killed. Ignored when not running as root."""

    extra_ro_binds: list[str] = []
    """Host paths bound read-only into the bwrap sandbox at the same place (for example a data
    directory the tests need). Never bind the project checkout, /root or anything with secrets."""

    env: dict[str, str] = {}
    """Extra environment variables set inside the sandbox (the host environment is never passed
    through; only a minimal PATH/HOME/LANG set plus these)."""

    workdir_root: str | None = None
    """Directory under which per-run host directories are created (rlimit layer); None uses the
    system temporary directory."""

    @model_validator(mode="after")
    def _check(self) -> "SandboxConfig":
        for p in self.extra_ro_binds:
            if not p.startswith("/"):
                raise ValueError(f"extra_ro_binds entries must be absolute paths, got '{p}'")
        return self


class CodeEnvConfig(Section):
    """The multi-turn code environment: turns, prompts, feedback and reward shaping."""

    max_turns: int = Field(3, ge=1)
    """Attempts per episode; the episode ends on success or after this many turns."""

    exec_timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one attempt (loading the code plus all hidden tests)."""

    test_timeout_s: float = Field(3.0, gt=0)
    """Limit of loading the code and of each single test inside the attempt, in the worker's time:
    the wall clock while the candidate is called, less the time the host's load kept the worker
    (or the grader) waiting for a CPU (meshrl.envs.grading)."""

    system_prompt: str | None = None
    """System message at the start of every episode; None adds none."""

    instructions: str = (
        "Write the complete Python function `{entry_point}` (with any imports it needs) in one "
        "```python code block. It is run against hidden tests and you will see the results; "
        "you have {max_turns} attempt(s)."
    )
    """Appended to each task's prompt; `{entry_point}` and `{max_turns}` are substituted."""

    feedback_role: Literal["user", "tool"] = "user"
    """Role of the feedback message the runtime appends after each attempt."""

    max_feedback_chars: int = Field(1500, ge=200)
    """Program output shown in the feedback is cut to this many characters."""

    reveal_failed_tests: bool = False
    """Show the source of failing hidden tests (and the value returned) in the feedback; off keeps
    the tests hidden and shows only which test failed and the error raised."""

    submit_ends_episode: bool = True
    """A `submit` tool call ends the episode whatever the result; a fenced block or `run_python`
    ends it only on success or at the turn limit."""

    reward_mode: Literal["final", "per_turn"] = "final"
    """`final`: every step reward is 0 except the last, which carries the whole episode reward.
    `per_turn`: each attempt is rewarded for itself and the bonus/penalty come on the last step."""

    tests_weight: float = 1.0
    """Reward weight of the fraction of hidden tests passed (by the last attempt in `final` mode)."""

    success_bonus: float = 0.5
    """Added when the episode ends with every test passing."""

    exec_success_weight: float = 0.1
    """Added when the last attempt's code loaded and ran without an error of its own."""

    turn_limit_penalty: float = 0.0
    """Subtracted when the episode ends at the turn limit without success."""

    turn_cost: float = 0.0
    """Subtracted per attempt after the first, favouring solving in fewer turns."""


class EnvConfig(Section):
    """Agentic environments: the sandbox and the code task."""

    sandbox: SandboxConfig = SandboxConfig()
    """Sandbox that runs the model's code."""

    code: CodeEnvConfig = CodeEnvConfig()
    """Multi-turn code-execution environment."""

    task_source: Literal["meshrl", "meshrl_easy", "humaneval"] = "meshrl"
    """Bundled meshrl function-writing tasks, their easy tier `meshrl_easy` (one-line functions
    such as adding a constant or joining words, that a 135M model sometimes solves: groups with
    some successes for RL), or HumanEval (evaluation)."""

    split: Literal["train", "test", "all"] = "train"
    """Split of the bundled tasks (HumanEval has only one)."""

    difficulty: list[int] | None = None
    """Keep only these difficulties (1-3) of the bundled tasks; None keeps all."""

    task_limit: int | None = Field(None, ge=1)
    """Use at most this many tasks (the first ones in file order); None uses all."""
