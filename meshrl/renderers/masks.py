"""Assistant-token masks for ANY chat template, by incremental rendering and one tokenisation.

For a conversation m_0..m_{n-1}, the tokenizer's own template renders the whole text once, which is
tokenised once with character offsets.  Assistant message i occupies the characters
    [len(template(m_0..m_{i-1}, add_generation_prompt=True)),  len(template(m_0..m_i)))
provided both renderings are prefixes of the whole text (checked: a template that rewrites earlier
turns, e.g. by dropping old reasoning, raises ValueError).  A token is masked when its character
span overlaps that range (a token merged across the header/content boundary counts as content).
Tokens after the last end-of-turn token of the range (such as ChatML's trailing "\n") stay
unmasked, because the model stops generating at the end-of-turn token.

Character offsets (rather than comparing token prefixes) make this work even when the generation
header tokenises differently alone than in front of the content (e.g. a trailing "\n\n").
"""

from __future__ import annotations

from typing import Iterable, Sequence

from meshrl.renderers.base import Message


def _template_text(tokenizer, messages: Sequence[Message], add_generation_prompt: bool, chat_template) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )


def assistant_token_mask(
    tokenizer,
    messages: Sequence[Message],
    end_of_turn_ids: Iterable[int] | None = None,
    chat_template: str | None = None,
) -> tuple[list[int], list[int]]:
    """(tokens, mask) with mask 1 on every assistant message's tokens up to its end-of-turn token.

    ``tokens`` is the tokenisation of the template's text (no extra BOS/EOS).  ``end_of_turn_ids``
    defaults to the tokenizer's EOS id; ``chat_template`` overrides the tokenizer's template.
    Needs a fast tokenizer (character offsets).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("assistant_token_mask needs a fast tokenizer (character offsets)")
    if end_of_turn_ids is None:
        end_of_turn_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stops = set(end_of_turn_ids)
    text = _template_text(tokenizer, messages, False, chat_template)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = list(encoded["input_ids"])
    offsets = [tuple(o) for o in encoded["offset_mapping"]]
    mask = [0] * len(tokens)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if i == 0:
            raise ValueError("an assistant message cannot be first: its prompt would be empty")
        before = _template_text(tokenizer, messages[:i], True, chat_template)
        through = _template_text(tokenizer, messages[: i + 1], False, chat_template)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ValueError(
                f"chat template is not prefix-stable at assistant message {i}: rendering the conversation "
                f"up to it is not a prefix of rendering the whole conversation"
            )
        start, end = len(before), len(through)
        span = [j for j, (a, b) in enumerate(offsets) if b > start and a < end]
        stop_positions = [j for j in span if tokens[j] in stops]
        if stop_positions:
            span = [j for j in span if j <= stop_positions[-1]]
        for j in span:
            mask[j] = 1
    return tokens, mask
