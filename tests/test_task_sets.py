"""Task sets: `trainer.seed` orders the training stream (one implementation for every task), the
stream is resumable from a cursor, and the held-out split does not depend on it."""

import pytest

from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.envs.task_sets import SeededStream, make_task


def _ids(task, cursor, n):
    return [getattr(p, "id", None) or getattr(p, "task_id") for p in task.train_batch(cursor, n)]


def _triples(task, cursor, n):
    return [(p.meta["a"], p.meta["b"]) for p in task.train_batch(cursor, n)]


def test_seed_zero_keeps_the_first_epoch_in_order_and_later_epochs_shuffle():
    stream = SeededStream(list(range(10)), seed=0)
    assert [x for _, x in stream.batch(0, 10)] == list(range(10))
    second = [x for _, x in stream.batch(10, 10)]
    assert sorted(second) == list(range(10)) and second != list(range(10))


def test_trainer_seed_changes_the_arithmetic_training_order_only():
    cfg = load_config(RunConfig, None, [])
    a, a_again, b = make_task(cfg.task, 0), make_task(cfg.task, 0), make_task(cfg.task, 7)
    assert _triples(a, 0, 16) == _triples(a_again, 0, 16)
    assert _triples(a, 0, 16) != _triples(b, 0, 16)
    assert {p.answer for p in a.heldout()} == {p.answer for p in b.heldout()}  # same held-out split
    assert [p.messages for p in a.heldout()] == [p.messages for p in b.heldout()]
    # a permutation of the same training problems, resumable from any cursor
    assert sorted(_triples(b, 0, a.train_size)) == sorted(_triples(a, 0, a.train_size))
    assert _triples(b, 5, 3) == _triples(b, 0, 8)[5:]
    held = {(p.meta["a"], p.meta["b"]) for p in b.heldout()}
    assert not held & set(_triples(b, 0, 300))


def test_trainer_seed_changes_the_code_training_order():
    cfg = load_config(RunConfig, None, ["task.kind=code"])
    a, b = make_task(cfg.task, 0), make_task(cfg.task, 3)
    n = len(a.stream.items)
    assert sorted(_ids(a, 0, n)) == sorted(_ids(b, 0, n)) and _ids(a, 0, n) != _ids(b, 0, n)
    assert _ids(b, 2, 4) == _ids(b, 0, 6)[2:]
    assert a.multi_turn and not make_task(load_config(RunConfig, None, []).task).multi_turn


def test_empty_stream_is_an_error():
    with pytest.raises(ValueError, match="at least one item"):
        SeededStream([], 0)
