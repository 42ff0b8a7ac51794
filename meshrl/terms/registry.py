"""Which loss terms a run has, from its config: the built-in ones (the policy-gradient term; SDPO
when `sdpo.alpha` > 0; trace-replay DPO when `replay.beta` > 0), then those of `trainer.terms`,
registered with `register_term` by a module the run names in `plugins`.

`check_config` imports the plugins and checks every name and parameter the config gives a loss or
a term against what is registered, raising a one-line `ConfigError` that names the key; it runs
before any process is spawned (and in `meshrl train --dry-run`).
"""

from __future__ import annotations

from typing import Callable

from pydantic import ValidationError

from meshrl.config.base import ConfigError, format_validation_error
from meshrl.losses.registry import LOSSES, get_loss, losses_of_kind
from meshrl.plugins import PluginError, import_plugins
from meshrl.terms.base import LossTerm, TermContext

TERMS: dict[str, type[LossTerm]] = {}
"""Terms a config can name in `trainer.terms`, by name."""


def register_term(name: str, *, prefix: str | None = None) -> Callable[[type[LossTerm]], type[LossTerm]]:
    """Class decorator: make the `LossTerm` subclass selectable as ``name`` in `trainer.terms`
    (`loss/<name>` reports it; its learner metrics go under ``prefix``, default ``name``)."""

    def decorate(cls: type[LossTerm]) -> type[LossTerm]:
        if name in TERMS or name in BUILT_IN_NAMES:
            raise ValueError(f"loss term {name!r} is registered twice")
        if not (isinstance(cls, type) and issubclass(cls, LossTerm)):
            raise TypeError(f"register_term({name!r}) decorates a subclass of meshrl.terms.LossTerm")
        cls.name, cls.prefix = name, prefix or name
        TERMS[name] = cls
        return cls

    return decorate


BUILT_IN_NAMES = ("grpo", "sdpo_jsd", "replay_dpo")


def _built_in(cfg) -> list[type[LossTerm]]:
    """The built-in terms ``cfg`` turns on, in order."""
    from meshrl.terms.policy_gradient import PolicyGradientTerm
    from meshrl.terms.replay import replay_term_class
    from meshrl.terms.sdpo import SDPOTerm

    out: list[type[LossTerm]] = []
    if cfg.diloco.role != "generate":  # a generation job samples for others and trains nothing
        out.append(PolicyGradientTerm)
    if cfg.sdpo.alpha > 0:
        out.append(SDPOTerm)
    if cfg.replay.beta > 0:
        out.append(replay_term_class(cfg))
    return out


def check_config(cfg, trains: bool = True) -> None:
    """Import `plugins`; refuse `generator.lora_slots` (the API's); check `trainer.loss` and
    `trainer.terms` against the registries and, for a run that ``trains`` (not `meshrl eval`), that
    the learner can score the rollouts' sampling distribution (ConfigError in one line naming the
    key)."""
    try:
        import_plugins(cfg.plugins)
    except PluginError as e:
        raise ConfigError(str(e)) from None
    if cfg.generator.lora_slots:
        raise ConfigError(f"config: generator.lora_slots = {cfg.generator.lora_slots} is for the API's generators (meshrl "
                          "serve, meshrl.api): a run's generators hold one merged weight version; set it to 0")
    top_p = cfg.generator.sampling.top_p
    if trains and top_p < 1:
        raise ConfigError(f"config: generator.sampling.top_p = {top_p}: training needs 1.0; the learner scores "
                          "sampled tokens under the whole distribution at generator.sampling.temperature and "
                          "cannot reproduce a nucleus-truncated one (top-p is for `meshrl eval` sampling)")
    loss = cfg.trainer.loss
    if loss.name not in LOSSES or LOSSES[loss.name].kind != "policy_gradient":
        what = "not a registered loss" if loss.name not in LOSSES else f"a {LOSSES[loss.name].kind} loss"
        raise ConfigError(f"config: trainer.loss.name = {loss.name!r}: {what}; expected a policy_gradient loss: "
                          f"{losses_of_kind('policy_gradient')} (or one registered by a module in plugins)")
    try:
        get_loss(loss.name).config(loss.params)
    except ValueError as e:
        raise ConfigError(f"config: trainer.loss.params: {e}") from None
    for i, term in enumerate(cfg.trainer.terms):
        key = f"trainer.terms.{i}"
        if term.name not in TERMS:
            raise ConfigError(f"config: {key}.name = {term.name!r}: not a registered loss term; registered: "
                              f"{sorted(TERMS)} (meshrl.terms.register_term, in a module named in plugins)")
        cls = TERMS[term.name]
        try:
            cls.Params.model_validate(term.params)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, f"config: {key}.params")) from None
        if cls.loss not in LOSSES:
            raise ConfigError(f"config: {key}.name = {term.name!r}: its loss {cls.loss!r} is not registered")


def term_classes(cfg) -> list[type[LossTerm]]:
    """The classes of the terms ``cfg`` asks for (call `check_config` first), in order."""
    return _built_in(cfg) + [TERMS[t.name] for t in cfg.trainer.terms]


def build_terms(ctx: TermContext) -> list[LossTerm]:
    """The run's terms (their meshes spawned and ready), in order; a failure closes those built."""
    cfg = ctx.cfg
    terms: list[LossTerm] = []
    try:
        for cls in _built_in(cfg):
            terms.append(cls(ctx))
        for spec in cfg.trainer.terms:
            cls = TERMS[spec.name]
            terms.append(cls(ctx, spec.weight, cls.Params.model_validate(spec.params)))
    except BaseException:
        for term in terms:
            term.close()
        raise
    return terms
