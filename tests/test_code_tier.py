"""The easy code tier (`task.code.env.task_source: meshrl_easy`): selected through the config, the
file is what its generator writes, train and test share families but no task or function name,
every reference passes its hidden tests in the sandbox (and do-nothing stubs do not), and a code
run on the tier evaluates on the tier's own test split."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from meshrl.config.base import ConfigError, load_config
from meshrl.config.env import EnvConfig
from meshrl.config.run import RunConfig
from meshrl.config.task import CodeTaskConfig
from meshrl.envs.code_env import tasks_from_config
from meshrl.envs.grading import grade_many
from meshrl.envs.sandbox import Sandbox
from meshrl.envs.task_sets import CodeTaskSet, make_task
from meshrl.envs.tasks import EASY_CODE_TASKS_FILE

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_easy_code_tasks", ROOT / "scripts" / "make_easy_code_tasks.py")
generator = sys.modules["make_easy_code_tasks"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generator)


def easy(split: str) -> list:
    return tasks_from_config(EnvConfig(task_source="meshrl_easy", split=split))


def _ids(tasks) -> list[str]:
    return [t.task_id for t in tasks]


@pytest.fixture(scope="module")
def sb():
    s = Sandbox()
    yield s
    s.close()


def test_the_tier_is_selected_by_task_source_and_has_its_own_tasks():
    train, test, every = easy("train"), easy("test"), easy("all")
    assert len(test) >= 50 and len(train) >= 150 and len(train) + len(test) == len(every)
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    for t in every:
        assert t.task_id == f"easy/{t.entry_point}" and t.source == "meshrl_easy" and t.difficulty == 1
        assert 3 <= len(t.tests) <= 6 and all(tc.call.startswith(t.entry_point + "(") for tc in t.tests)
        assert f"def {t.entry_point}(" in t.prompt and t.reference not in t.prompt
    assert not set(_ids(every)) & set(_ids(tasks_from_config(EnvConfig(split="all"))))
    limited = tasks_from_config(EnvConfig(task_source="meshrl_easy", task_limit=5))
    assert _ids(limited) == _ids(train)[:5]
    with pytest.raises(ConfigError, match="task_source"):
        load_config(RunConfig, None, ["task.code.env.task_source=meshrl_hard"])


def test_the_file_is_what_the_generator_writes():
    assert EASY_CODE_TASKS_FILE.read_text(encoding="utf-8") == generator.render()


def test_splits_share_families_but_no_task_or_function_name():
    train, test = easy("train"), easy("test")
    assert not set(_ids(train)) & set(_ids(test))
    assert not {t.entry_point for t in train} & {t.entry_point for t in test}
    family = lambda tasks: Counter(t.metadata["family"] for t in tasks)  # noqa: E731
    assert set(family(test)) == set(family(train))  # every held-out skill is also trained on
    assert max(family(test).values()) <= 3  # no family dominates the held-out score


@pytest.mark.slow
def test_every_reference_passes_its_tests_and_stubs_fail(sb):
    tasks = easy("all")
    results = grade_many([(t, t.reference) for t in tasks], sb)
    assert [(t.task_id, r.error_kind, r.error_text[:200]) for t, r in zip(tasks, results) if not r.success] == []
    stubs = [(t, f"def {t.entry_point}(*args):\n    return {value}\n") for t in tasks for value in ("None", "0")]
    assert [t.task_id for (t, _), r in zip(stubs, grade_many(stubs, sb)) if r.success] == []


def test_a_code_run_on_the_tier_trains_on_its_train_split_and_evaluates_on_its_test_split():
    cfg = load_config(RunConfig, None, ["task.kind=code", "task.code.env.task_source=meshrl_easy",
                                        "task.code.env.task_limit=20", "task.code.heldout_limit=30"])
    task = make_task(cfg.task)
    assert _ids(task.train_batch(0, 20)) == _ids(easy("train"))[:20]
    assert _ids(task.heldout()) == _ids(easy("test"))[:30] and _ids(task.heldout(4)) == _ids(easy("test"))[:4]


def test_the_other_sources_keep_their_held_out_sets():
    meshrl_test = _ids(tasks_from_config(EnvConfig(split="test")))
    assert _ids(CodeTaskSet(CodeTaskConfig()).heldout()) == meshrl_test
    on_humaneval = CodeTaskConfig(env=EnvConfig(task_source="humaneval", task_limit=3))
    assert _ids(CodeTaskSet(on_humaneval).heldout()) == meshrl_test
    humaneval_eval = CodeTaskConfig(env=EnvConfig(task_source="meshrl_easy"), heldout_split="humaneval",
                                    heldout_limit=5)
    assert _ids(CodeTaskSet(humaneval_eval).heldout()) == [f"HumanEval/{i}" for i in range(5)]
