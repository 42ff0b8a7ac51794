"""Renderers against the tokenizer's own chat template (real SmolLM2 tokenizer; Llama-3 template text).

Llama-3: no Llama-3 tokenizer is available offline, so its tests use a copy of the SmolLM2 tokenizer
with the four Llama-3 special tokens added and the official Meta-Llama-3-Instruct chat template.
They prove the renderer reproduces the template's text structure, BOS placement, trimming and
special-token segmentation; they do not prove anything about the real Llama-3 BPE merges.
"""

import copy

import jinja2
import pytest

from meshrl.renderers import (
    ChatMLRenderer,
    Llama3Renderer,
    assistant_token_mask,
    get_renderer,
    renderer_for_tokenizer,
)
from meshrl.types import Datum

# The chat template shipped in Meta-Llama-3-8B-Instruct's tokenizer_config.json.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "Write code:\n\n```python\ndef f(x):\n    return x  # ok\n```\n"},
     {"role": "assistant", "content": "\n\nSure:  spaces   and\ttabs \n"},
     {"role": "user", "content": "  leading and trailing whitespace  "},
     {"role": "assistant", "content": "Ünïcödé ✓ 日本語 🙂"}],
    [{"role": "user", "content": "List files"},
     {"role": "assistant", "content": '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'},
     {"role": "tool", "content": "a.txt\nb.txt"},
     {"role": "assistant", "content": "Two files."}],
]


def template_tokens(tokenizer, messages, add_generation_prompt):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def chatml(smollm_tokenizer):
    return renderer_for_tokenizer(smollm_tokenizer)


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)  # never mutate the shared session tokenizer
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


# ----------------------------------------------------------------------------- ChatML / SmolLM2


def test_picks_chatml_with_smollm_default_system_prompt(chatml, smollm_tokenizer):
    assert isinstance(chatml, ChatMLRenderer)
    assert chatml.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert chatml.get_stop_sequences() == [smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert get_renderer("chatml", smollm_tokenizer).default_system_prompt == chatml.default_system_prompt


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chatml_equals_apply_chat_template(chatml, smollm_tokenizer, index, add_generation_prompt):
    messages = CONVERSATIONS[index]
    expected = template_tokens(smollm_tokenizer, messages, add_generation_prompt)
    assert chatml.render(messages, add_generation_prompt) == expected
    encoded = smollm_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    assert list(ids) == expected


def test_generation_prompt_only_when_asked(chatml, smollm_tokenizer):
    messages = CONVERSATIONS[0]
    without = chatml.render(messages)
    with_prompt = chatml.build_generation_prompt(messages)
    assert with_prompt[: len(without)] == without
    assert smollm_tokenizer.decode(with_prompt[len(without):]) == "<|im_start|>assistant\n"
    assert smollm_tokenizer.decode(without).endswith("Hi there<|im_end|>\n")
    # the template inserts no default system prompt before an empty chat (transformers refuses to
    # render one, so compare with jinja directly)
    text = jinja2.Template(smollm_tokenizer.chat_template).render(messages=[], add_generation_prompt=True)
    assert smollm_tokenizer.decode(chatml.build_generation_prompt([])) == text == "<|im_start|>assistant\n"


def test_parse_response_round_trip(chatml, smollm_tokenizer):
    im_end = chatml.get_stop_sequences()[0]
    for content in ["4", "Two lines\nof text.", "  padded  ", "Ünïcödé 🙂"]:
        sampled = list(smollm_tokenizer.encode(content, add_special_tokens=False)) + [im_end]
        assert chatml.parse_response(sampled) == ({"role": "assistant", "content": content}, True)
    truncated = list(smollm_tokenizer.encode("cut off mid", add_special_tokens=False))
    assert chatml.parse_response(truncated) == ({"role": "assistant", "content": "cut off mid"}, False)
    trailing = list(smollm_tokenizer.encode("done", add_special_tokens=False)) + [im_end, 42, 43]
    assert chatml.parse_response(trailing) == ({"role": "assistant", "content": "done"}, True)
    # whole-conversation round trip: decoding the rendering gives the template text back
    messages = CONVERSATIONS[2]
    text = smollm_tokenizer.apply_chat_template(messages, tokenize=False)
    assert smollm_tokenizer.decode(chatml.render(messages)) == text


def _simulate_rollout(renderer, tokenizer, conversation, template_text):
    """Play a conversation token-in/token-out: sample = encode(content) + stop, then bridge.

    Also checks every bridge against the template: the appended tokens must be the tokenisation of
    exactly the text the template adds after the assistant's end-of-turn token (that text starts at
    a special-token boundary, so it tokenises independently of what precedes it).
    """
    stop = renderer.get_stop_sequences()[0]
    first_assistant = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    tokens = renderer.build_generation_prompt(conversation[:first_assistant])
    i = first_assistant
    while i < len(conversation):
        tokens += list(tokenizer.encode(conversation[i]["content"], add_special_tokens=False)) + [stop]
        j = i + 1
        while j < len(conversation) and conversation[j]["role"] != "assistant":
            j += 1
        if j == i + 1:
            break
        appended = renderer.bridge(tokens, conversation[i + 1: j], add_generation_prompt=True)
        through = template_text(conversation[: i + 1], False)
        after_stop = through.rindex(tokenizer.decode([stop])) + len(tokenizer.decode([stop]))
        added_text = template_text(conversation[:j], True)[after_stop:]
        assert appended == list(tokenizer.encode(added_text, add_special_tokens=False))
        tokens += appended
        i = j
    return tokens


def test_multi_turn_bridging_equals_rendering_whole_conversation(chatml, smollm_tokenizer):
    conversation = [
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "Calling ls."},
        {"role": "tool", "content": "a.txt\nb.txt"},
        {"role": "assistant", "content": "Two files. Anything else?"},
        {"role": "user", "content": "Count lines"},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3 lines."},
        {"role": "user", "content": "Thanks"},
    ]
    def template_text(messages, add_generation_prompt):
        return smollm_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    tokens = _simulate_rollout(chatml, smollm_tokenizer, conversation, template_text)
    assert tokens == template_tokens(smollm_tokenizer, conversation, add_generation_prompt=True)


def test_bridging_keeps_sampled_tokens_and_closes_truncated_turns(chatml, smollm_tokenizer):
    prompt = chatml.build_generation_prompt([{"role": "user", "content": "Say hello"}])
    # a non-canonical tokenisation of "Hello" (one token per character): kept as sampled
    sampled = [smollm_tokenizer.convert_tokens_to_ids(c) for c in "Hello"]
    assert smollm_tokenizer.decode(sampled) == "Hello"
    assert sampled != list(smollm_tokenizer.encode("Hello", add_special_tokens=False))
    tool = [{"role": "tool", "content": "ok"}]
    appended = chatml.bridge(prompt + sampled, tool)  # truncated: no <|im_end|> was sampled
    assert smollm_tokenizer.decode(appended) == "<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    finished = chatml.bridge(prompt + sampled + chatml.get_stop_sequences(), tool, add_generation_prompt=False)
    assert smollm_tokenizer.decode(finished) == "\n<|im_start|>tool\nok<|im_end|>\n"


def test_supervised_example_weights(chatml, smollm_tokenizer):
    messages = CONVERSATIONS[3]
    tokens, weights = chatml.build_supervised_example(messages)
    assert tokens == template_tokens(smollm_tokenizer, messages, False)
    trained = smollm_tokenizer.decode([t for t, w in zip(tokens, weights) if w])
    assert trained == messages[1]["content"] + "<|im_end|>" + messages[3]["content"] + "<|im_end|>"
    # the template-generic incremental-tokenisation mask agrees token for token
    mask_tokens, mask = assistant_token_mask(smollm_tokenizer, messages)
    assert mask_tokens == tokens and mask == [int(w) for w in weights]
    _, last_only = chatml.build_supervised_example(messages, only_last_assistant=True)
    assert smollm_tokenizer.decode([t for t, w in zip(tokens, last_only) if w]) == "Two files.<|im_end|>"
    # weights survive the causal shift into a Datum: target position i-1 carries token i's weight
    datum = Datum.from_sequence(tokens, weights=weights)
    assert datum.loss_fn_inputs["weights"].tolist() == weights[1:]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == tokens[1:]


@pytest.mark.parametrize("index", [1, 2, 3])
def test_supervised_weights_equal_template_mask_including_boundary_merges(chatml, llama3_tokenizer,
                                                                         smollm_tokenizer, index):
    # CONVERSATIONS[2] starts an assistant message with "\n\n": in ChatML "assistant\n\n\n" the
    # tokenizer merges the header's "\n" with the content's first "\n" into one token.
    messages = CONVERSATIONS[index]
    for renderer, tok in ((chatml, smollm_tokenizer), (get_renderer("llama3", llama3_tokenizer), llama3_tokenizer)):
        tokens, weights = renderer.build_supervised_example(messages)
        mask_tokens, mask = assistant_token_mask(tok, messages)
        assert tokens == mask_tokens
        assert [int(w) for w in weights] == mask
        assert sum(mask) > 0


def test_assistant_mask_rejects_templates_that_rewrite_history(smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)
    tok.chat_template = (  # prefix-unstable: a message count at the start changes with every turn
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-stable"):
        assistant_token_mask(tok, CONVERSATIONS[1][1:3])


# ----------------------------------------------------------------------------- Llama-3


def _jinja_llama3(messages, add_generation_prompt):
    return jinja2.Template(LLAMA3_TEMPLATE).render(
        messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_llama3_equals_official_template(llama3_tokenizer, index):
    renderer = renderer_for_tokenizer(llama3_tokenizer)
    assert isinstance(renderer, Llama3Renderer)
    messages = CONVERSATIONS[index]
    for add_generation_prompt in (False, True):
        text = _jinja_llama3(messages, add_generation_prompt)
        assert text == llama3_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        tokens = renderer.render(messages, add_generation_prompt)
        assert tokens == list(llama3_tokenizer.encode(text, add_special_tokens=False))
        assert llama3_tokenizer.decode(tokens) == text
    assert text.startswith("<|begin_of_text|><|start_header_id|>") and text.count("<|begin_of_text|>") == 1


def test_llama3_bridging_masks_and_parsing(llama3_tokenizer):
    renderer = get_renderer("llama3", llama3_tokenizer)
    eot = llama3_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert renderer.get_stop_sequences() == [eot]
    conversation = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "Calling ls."},
        {"role": "ipython", "content": "a.txt"},
        {"role": "assistant", "content": "One file."},
        {"role": "user", "content": "Thanks"},
    ]
    tokens = _simulate_rollout(renderer, llama3_tokenizer, conversation, _jinja_llama3)
    # Whole-sequence equality would hold only where the stand-in BPE tokenises the generation
    # header's "\n\n" the same alone as in front of content; SmolLM2's does not ("\n\n" alone is one
    # token, "\n\nCalling" starts with two), so compare the decoded text instead.
    assert llama3_tokenizer.decode(tokens) == _jinja_llama3(conversation, True)
    sup_tokens, weights = renderer.build_supervised_example(conversation[:5])
    mask_tokens, mask = assistant_token_mask(llama3_tokenizer, conversation[:5])
    assert sup_tokens == mask_tokens and [int(w) for w in weights] == mask
    assert llama3_tokenizer.decode([t for t, w in zip(sup_tokens, weights) if w]) == (
        "Calling ls.<|eot_id|>One file.<|eot_id|>")
    sampled = list(llama3_tokenizer.encode("Hi!", add_special_tokens=False)) + [eot]
    assert renderer.parse_response(sampled) == ({"role": "assistant", "content": "Hi!"}, True)


def test_renderer_errors(smollm_tokenizer):
    with pytest.raises(ValueError, match="unknown renderer"):
        get_renderer("mistral", smollm_tokenizer)
    with pytest.raises(ValueError, match="no special token '<\\|begin_of_text\\|>'"):
        get_renderer("llama3", smollm_tokenizer)
    tok = copy.deepcopy(smollm_tokenizer)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="neither ChatML nor Llama-3"):
        renderer_for_tokenizer(tok)
    tok.chat_template = (  # ChatML markers but a different layout: the probe check must catch it
        "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match="does not reproduce"):
        renderer_for_tokenizer(tok)
    with pytest.raises(TypeError, match="content must be a string"):
        get_renderer("chatml", smollm_tokenizer).render([{"role": "user", "content": [{"type": "text"}]}])
