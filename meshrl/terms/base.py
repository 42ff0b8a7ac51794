"""Loss terms: the parts of a step's loss, as plug-ins of the GRPO loop (meshrl.controller.grpo).

A step's loss is the sum of its terms' weighted losses. The loop knows no term by name: it calls
every term's hooks, in the terms' order (the policy-gradient term first), at fixed points of a step:

  start_step(step)         learner side, as step ``step`` (1-based) begins: drop what an unfinished
                           step gathered; a weight schedule (`weight`) may change here
                           (a step that failed, e.g. with its learner, is run again from the start)
  produce(unit, state)     producer thread, once per unit of rollouts, while the weights that sampled
                           it are loaded: score what was sampled, put it in ``unit.extras``
  receive(unit)            learner side, as each unit arrives: take what the term needs from it
  train_piece(groups)      learner side, each piece of a substep's groups as soon as it is complete
  finish(version, metrics) at each optimizer step, before it: what the term has gathered, as a
                           `LossPart` (`part`) for the step's shared pass, or its weighted loss if
                           it trained itself (None: the term trains nothing)
  trained(part, result, metrics)  after the shared pass: the term's metrics; its weighted loss
  end_step(output, metrics) after the step: what the term hands out with the step's groups
  take_records()           after the step: the data records it made (for its `records_file`)

A term trains through its registered loss (``loss``, ``loss_config()``; meshrl.losses), weighted by
``weight``; ``loss/<name>`` is its unweighted loss and its learner metrics go under ``<prefix>/``.
The parts the terms hand over at an optimizer step are trained together (`finish_terms`): one set
of micro-batches, each distinct token sequence forwarded once for every term that reads it (SDPO's
student sequence at an error site is a trajectory the policy-gradient term trains), each term's
loss on its own rows, at its own temperature and config; the gradients are those of a pass per
term.
What a term keeps between steps goes into checkpoints (``state_dict``). A term of your own is a
subclass registered with `register_term` (meshrl.terms.registry) and named in `trainer.terms`;
`DatumTerm` is the simplest start: it turns each unit's samples into datums for one loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from meshrl.config.base import Section
from meshrl.losses.registry import NoParams
from meshrl.types import Datum, LossPart


@dataclass
class TermContext:
    """What a term is built with: the run's config, its supervised mesh calls (a
    `meshrl.meshes.client.MeshClient`) and the model's renderer."""

    cfg: Any
    client: Any
    renderer: Any


@dataclass
class StepOutput:
    """What a step hands out at its end: the groups it trained on (a generation job: every group it
    sampled) and data terms export with them (a generation job's teacher preference pairs)."""

    step: int
    published: int
    """The newest weight version published when the step ended."""
    trajectories: list
    pairs: list = field(default_factory=list)


def add_metrics(metrics: dict, more: dict) -> None:
    """Sum ``more`` into ``metrics`` key by key."""
    for k, v in more.items():
        metrics[k] = metrics.get(k, 0.0) + v


class LossTerm:
    """One term of the step's loss; every hook does nothing unless overridden (see the module
    docstring for when the loop calls each)."""

    name: ClassVar[str] = ""
    """`loss/<name>` reports the term's unweighted loss (set by `register_term`)."""
    prefix: ClassVar[str] = ""
    """Metrics of the term's learner calls are reported as `<prefix>/<metric>`."""
    loss: ClassVar[str] = ""
    """The registered loss the term trains with."""
    Params: ClassVar[type[Section]] = NoParams
    """The term's own parameters (`trainer.terms[].params`), as a typed config."""

    trains: bool = True
    """False for a term that only exports data (its `finish` returns None)."""
    records_file: ClassVar[str | None] = None
    """The JSONL file of the run directory the term's data records go to (`take_records`); None:
    the term keeps none."""

    sampled: ClassVar[bool] = False
    """Whether the term's datums are the generators' samples, with the sampler's `logprobs`: the
    learner then scores their tokens at the sampling temperature (`logprob_temperature`)."""

    def __init__(self, ctx: TermContext, weight: float = 1.0, params: Section | None = None):
        self.ctx = ctx
        self.client = ctx.client
        self.weight = weight
        self.params = params if params is not None else self.Params()

    @classmethod
    def reads_weights(cls, cfg) -> bool:
        """Whether the meshes the term spawns for ``cfg`` pull every published weight version."""
        return False

    @classmethod
    def spawn(cls, session, cfg) -> None:
        """Spawn the meshes the term needs on ``session`` (a `meshrl.meshes.session.MeshSession`),
        before the run's meshes are waited for."""

    def loss_config(self) -> dict:
        """The ``loss_fn_config`` of the term's learner calls."""
        return {}

    def logprob_temperature(self) -> float:
        """The temperature at which the learner scores the tokens of the term's datums: for a
        `sampled` term the rollouts' (`generator.sampling.learner_temperature`), so that its
        ratios to the sampler's logprobs are 1 on policy; else 1 (the model's own distribution)."""
        return self.ctx.cfg.generator.sampling.learner_temperature if self.sampled else 1.0

    def start_step(self, step: int) -> None:
        """Learner side: step ``step`` begins; forget what a step that did not finish had gathered."""

    def produce(self, unit, state) -> None:
        """Producer thread: called on each unit of rollouts; ``state.extra`` holds per-step counts
        (reset at every step and checkpointed with the producer)."""

    def receive(self, unit) -> None:
        """Learner side: called as each unit arrives, in order."""

    def train_piece(self, groups: list[list]) -> None:
        """Learner side: a piece of the substep's groups, complete (streamed as they come)."""

    def pending(self) -> bool:
        """Whether something waits for the next optimizer step."""
        return False

    def finish(self, version: int, metrics: dict) -> LossPart | float | None:
        """Before each optimizer step: what the term gathered, as a `LossPart` the step trains in
        its shared pass (then `trained` reports it), or the weighted loss of a term that trained
        itself; None: it trains nothing."""
        return None

    def trained(self, part: LossPart, result: dict, metrics: dict) -> float:
        """The shared pass trained the term's ``part``: ``result`` holds its learner metrics (they
        go under `<prefix>/`); returns the term's weighted loss."""
        add_metrics(metrics, {f"{self.prefix}/{k}": v for k, v in result.items() if k != "loss"})
        return result["loss"]

    def end_step(self, output: StepOutput, metrics: dict) -> None:
        """After the step's last optimizer step (and publish)."""

    def take_records(self) -> list[dict]:
        """The data records the term made during the step that just ended, for `records_file`
        (the controller appends them to the run directory after each step); none by default."""
        return []

    def part(self, datums: list[Datum], scale: float = 1.0) -> LossPart:
        """``datums`` (their weights carry the term's weight) as the term's part of the step's
        shared pass: its loss and config, scored at its temperature."""
        return LossPart(datums, self.loss, self.loss_config(), self.logprob_temperature(), scale)

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the term (None: nothing)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict`'s output."""

    def close(self) -> None:
        """Release what the term holds (the run is over)."""


def token_mean_weights(datums: list[Datum], weight: float) -> list[Datum]:
    """Each datum's non-zero `mask` tokens weighted ``weight / (those tokens over all datums)``, so
    the learner's sum-reduced loss is ``weight`` times the per-token mean (in place; returned)."""
    tokens = sum(float((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums)
    for d in datums:
        d.loss_fn_inputs["mask"] = (d.loss_fn_inputs["mask"] != 0).float() * (weight / tokens)
    return datums


class DatumTerm(LossTerm):
    """A term that turns each unit's samples into datums for its loss, in the producer thread
    (`make_datums`), and trains them at the next optimizer step with token-mean weights: its loss
    is ``weight`` times the per-token mean of the loss over their non-zero `mask` tokens."""

    sampled = True

    def __init__(self, ctx: TermContext, weight: float = 1.0, params: Section | None = None):
        super().__init__(ctx, weight, params)
        self.gathered: list[Datum] = []

    def make_datums(self, unit, state) -> list[Datum]:
        """The datums for ``unit`` (its trajectories: ``unit.sampled``); `mask` non-zero on the
        tokens the loss reads."""
        raise NotImplementedError

    def start_step(self, step: int) -> None:
        self.gathered = []

    def produce(self, unit, state) -> None:
        started = time.perf_counter()
        unit.extras[self.name] = self.make_datums(unit, state)
        unit.metrics[f"timing/{self.prefix}_s"] = time.perf_counter() - started

    def receive(self, unit) -> None:
        self.gathered += unit.extras.get(self.name, [])

    def pending(self) -> bool:
        return bool(self.gathered)

    def finish(self, version: int, metrics: dict) -> LossPart:
        datums, self.gathered = self.gathered, []
        return self.part(token_mean_weights(datums, self.weight) if datums else [])


def finish_terms(terms: list[LossTerm], version: int, metrics: dict, client) -> dict[str, float]:
    """Every term's `finish`, in order; the parts they hand over trained in one shared pass
    (``client.forward_backward_parts``: one set of micro-batches for all of them) and reported by
    their terms' `trained`. The weighted loss of each term that trains, by name (an empty part: 0)."""
    handed: list[tuple[LossTerm, LossPart]] = []
    losses: dict[str, float | None] = {}
    for term in terms:
        out = term.finish(version, metrics)
        if isinstance(out, LossPart):
            losses[term.name] = None if out.datums else 0.0
            if out.datums:
                handed.append((term, out))
        elif out is not None:
            losses[term.name] = out
    if handed:
        for (term, part), result in zip(handed, client.forward_backward_parts([p for _, p in handed])):
            losses[term.name] = term.trained(part, result, metrics)
    return losses
