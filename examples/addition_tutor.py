"""A multi-turn environment written against meshrl's contract (`meshrl.envs.base.Environment`), in which
the feedback is what makes success possible: "What is a + b?" with three attempts, and each wrong
answer buys a better clue. After the first the tutor says whether the answer was too high or too low
and which ten the sum lies in; after the second it gives the sum and asks for it back. Reward 1.0, 0.6 or
0.3 for a correct first, second or third answer, 0 otherwise, so the return measures how early the
policy gets there, and the success rate how well it uses the tutor.

Every wrong answer is an error site for SDPO (`error_kind` `wrong_answer` or `wrong_format`,
`hint_template_key` `tutor.<kind>`, and the mistake in `metadata['error_text']` for the hint
templates of `configs/env-tutor.yaml`); `state_at(t)` gives the exact messages the agent saw before
its t-th answer, for trace replay. Episodes: `reset(seed=i)` for the i-th training problem,
`reset(seed=i, split="test")` for the i-th held-out one.

    meshrl train -c configs/env-tutor.yaml
"""

from __future__ import annotations

from meshrl.config.task import ArithmeticConfig
from meshrl.envs.arithmetic import ArithmeticTask, extract_last_integer
from meshrl.envs.base import Environment, Observation, State, TextAction

REWARDS = (1.0, 0.6, 0.3)


class AdditionTutorEnv(Environment):
    """Two-digit addition with a tutor's escalating clues, three attempts."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, min_value: int = 10, max_value: int = 99):
        self.task = ArithmeticTask(ArithmeticConfig(min_value=min_value, max_value=max_value))
        self.problem = None
        self.messages: list[dict[str, str]] = []
        self.seen: list[list[dict[str, str]]] = []
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str = "train", **kwargs) -> Observation:
        if kwargs:
            raise TypeError(f"unexpected reset arguments: {sorted(kwargs)}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        held = self.task.heldout()
        self.problem = held[(seed or 0) % len(held)] if split == "test" else self.task.train_batch(seed or 0, 1)[0]
        question = self.problem.messages[-1]["content"] + " Reply with the number."
        self.messages, self.seen = [{"role": "user", "content": question}], []
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(text=question, metadata={"answer": int(self.problem.answer)})

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs) -> Observation:
        if self.problem is None or self._state.step_count >= len(REWARDS):
            raise RuntimeError("call reset() first: no episode is running")
        turn = self._state.step_count
        self._state.step_count += 1
        self.seen.append([dict(m) for m in self.messages])
        self.messages.append({"role": "assistant", "content": action.text})
        answer, got = int(self.problem.answer), extract_last_integer(action.text)
        if got == answer:
            return self._reply("Correct.", REWARDS[turn], done=True, success=True)
        kind = "wrong_format" if got is None else "wrong_answer"
        said = "You gave no number." if got is None else f"{got} is too {'high' if got > answer else 'low'}."
        last = self._state.step_count == len(REWARDS)
        if last:
            feedback = f"{said} The sum was {answer}."
        elif turn == 0:
            low = answer // 10 * 10
            feedback = f"{said} Clue: the sum is between {low} and {low + 9}. Try again."
        else:
            feedback = f"{said} The sum is {answer}. Reply with it."
        return self._reply(feedback, 0.0, done=last, success=False, error_kind=kind, hint_template_key=f"tutor.{kind}",
                           error_text=f"{said} The correct sum is {answer}.")

    def _reply(self, text: str, reward: float, done: bool, success: bool, error_kind: str | None = None,
               hint_template_key: str | None = None, error_text: str | None = None) -> Observation:
        self.messages.append({"role": "user", "content": text})
        return Observation(text=text, reward=reward, done=done, error_kind=error_kind, hint_template_key=hint_template_key,
                           metadata={"success": success, "error_text": error_text,
                                     "termination": ("success" if success else "out_of_attempts") if done else None})

    @property
    def state(self) -> State:
        return self._state

    def state_at(self, t: int) -> list[dict[str, str]]:
        return [dict(m) for m in self.seen[t]]
