"""What `meshrl sft` trains on, from one of three files (exactly one is set):

- `sft.data`: conversations (meshrl.training.conversations), rendered by the model's renderer into
  `cross_entropy` Datums, weight on the assistant turns;
- `sft.trajectories`: a run's `trajectories.jsonl` (meshrl.training.records): its successful
  trajectories (`correct`, or `reward >= sft.min_reward`) as `cross_entropy` Datums of the recorded
  token ids, weight on the policy's sampled tokens only, never decoded and rendered again;
- `sft.pairs`: a run's `pairs.jsonl` (meshrl.replay.pairs): its teacher preference pairs that were
  not dropped, as `dpo` Datum pairs (offline DPO against the frozen starting policy).

Every line is checked before anything is made; a bad one is one error naming `file:line`. The
examples are split into training and held-out sets (`sft.eval_fraction`, or `sft.eval_data` in the
same format), and each example becomes one training unit: one Datum, or a DPO pair's chosen and
rejected Datums.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from meshrl.replay.pairs import PreferenceItem, dpo_datums, item_from_record
from meshrl.training.conversations import read_conversations, supervised_datum
from meshrl.training.records import RecordFileError, read_records, sft_datum, successful
from meshrl.types import Datum

SOURCES = ("data", "trajectories", "pairs")
"""The `sft` keys naming a training file, one per kind of data."""


class SFTError(ValueError):
    """An SFT run that cannot start as configured; the message is one line."""


@dataclass
class SFTData:
    """The examples of a run: conversations (message lists), trajectory Datums or preference pairs."""

    source: str
    """Which `sft` key named the file (one of SOURCES)."""
    train: list
    held: list
    skipped: int = 0
    """Records of the file(s) not trained on: unsuccessful trajectories, dropped pairs."""

    @property
    def loss(self) -> str:
        return "dpo" if self.source == "pairs" else "cross_entropy"


def source_of(cfg) -> str:
    """The one `sft` key that names the training file; SFTError if none or several do."""
    given = [key for key in SOURCES if getattr(cfg.sft, key)]
    if len(given) != 1:
        what = "no training file given" if not given else f"{' and '.join('sft.' + k for k in given)} are all set"
        raise SFTError(f"{what}: name exactly one of a conversation file (meshrl sft DATA.jsonl), a trajectory file "
                       "(--trajectories) or a pairs file (--pairs)")
    return given[0]


def _trajectories(cfg, path: str) -> tuple[list[Datum], int]:
    """The Datums of the successful trajectories of ``path`` and how many records were not used
    (unsuccessful, or no sampled token within the length limit)."""
    max_length = cfg.sft.max_length or cfg.model.max_model_len
    datums, skipped = [], 0
    for where, record in read_records(path):
        if record.get("kind", "trajectory") != "trajectory":  # e.g. an evaluation episode's record
            continue
        datum = sft_datum(record, where, max_length) if successful(record, cfg.sft.min_reward) else None
        if datum is None:
            skipped += 1
            continue
        datums.append(datum)
    if not datums:
        rule = "`correct`" if cfg.sft.min_reward is None else f"reward >= {cfg.sft.min_reward:g} (sft.min_reward)"
        raise SFTError(f"{path}: no successful trajectory to train on ({rule}; {skipped} not used)")
    return datums, skipped


def _pairs(cfg, path: str) -> tuple[list[PreferenceItem], int]:
    """The preference pairs of ``path`` that were not dropped and fit `sft.max_length`, and how
    many were not used."""
    max_length = cfg.sft.max_length or cfg.model.max_model_len
    items, skipped = [], 0
    for where, record in read_records(path):
        if record.get("status") == "dropped":
            skipped += 1
            continue
        try:
            item = item_from_record(record)
        except (KeyError, TypeError, ValueError) as e:
            raise RecordFileError(f"{where}: not a preference pair ({type(e).__name__}: {e})") from None
        if len(item.prompt) + max(len(item.chosen), len(item.rejected)) > max_length:
            skipped += 1
            continue
        items.append(item)
    if not items:
        raise SFTError(f"{path}: no preference pair to train on ({skipped} dropped or longer than sft.max_length)")
    return items, skipped


def _read(cfg, source: str, path: str) -> tuple[list, int]:
    if source == "trajectories":
        return _trajectories(cfg, path)
    if source == "pairs":
        return _pairs(cfg, path)
    return read_conversations(path), 0


def load_data(cfg) -> SFTData:
    """The run's (training, held-out) examples: the file and `sft.eval_data`, or `sft.eval_fraction`
    of the file held out by a shuffle seeded with `sft.seed`. Raises ConversationFileError or
    RecordFileError (a bad line, named by file:line) or SFTError."""
    sc = cfg.sft
    source = source_of(cfg)
    train, skipped = _read(cfg, source, getattr(sc, source))
    if sc.eval_data:
        held, skipped_held = _read(cfg, source, sc.eval_data)
        return SFTData(source, train, held, skipped + skipped_held)
    if sc.eval_fraction == 0 or len(train) < 2:
        return SFTData(source, train, [], skipped)
    order = list(range(len(train)))
    random.Random(sc.seed).shuffle(order)
    held_out = set(order[: min(max(1, round(len(train) * sc.eval_fraction)), len(train) - 1)])
    return SFTData(source, [x for i, x in enumerate(train) if i not in held_out],
                   [x for i, x in enumerate(train) if i in held_out], skipped)


def units(cfg, renderer, data: SFTData, examples: list) -> tuple[list[list[Datum]], int]:
    """One training unit (its Datums) per example and how many examples were skipped (a
    conversation with no assistant token within `sft.max_length`)."""
    if data.source == "trajectories":
        return [[d] for d in examples], 0
    if data.source == "pairs":
        return [dpo_datums([item], 1.0) for item in examples], 0
    max_length = cfg.sft.max_length or cfg.model.max_model_len
    only_last = cfg.sft.train_on == "last_assistant"
    datums = [supervised_datum(renderer, c, max_length, only_last) for c in examples]
    return [[d] for d in datums if d is not None], sum(d is None for d in datums)


def check_vocabulary(data: SFTData, examples: list[list[Datum]], vocab: int) -> None:
    """SFTError if a token id of ``examples`` (training units) is outside the model's vocabulary
    of ``vocab`` tokens: the file was written with another model's tokenizer."""
    top = max((max(d.model_input.to_ints()[:1] + d.loss_fn_inputs["target_tokens"].tolist()) for unit in examples
               for d in unit), default=-1)
    if top >= vocab:
        raise SFTError(f"sft.{data.source}: token id {top} is outside the model's vocabulary of {vocab} tokens "
                       "(the file was written with another tokenizer)")
