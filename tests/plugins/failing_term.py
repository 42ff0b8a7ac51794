"""A loss term that cannot be built (tests/test_session.py: a failure midway through a run's
bring-up stops every mesh already spawned). It records the processes of the run's meshes first."""

from meshrl.terms import LossTerm, register_term

SEEN: dict[str, list[int]] = {}
"""The pids of the run's meshes when the term was being built, by mesh."""


@register_term("fails_to_build")
class FailsToBuild(LossTerm):
    loss = "cross_entropy"

    def __init__(self, ctx, weight=1.0, params=None):
        SEEN.update(ctx.client.meshes.pids)
        raise RuntimeError("this term cannot be built")
