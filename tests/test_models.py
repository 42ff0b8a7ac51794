"""Model provisioning: GGUF conversion fidelity, tiny-model determinism, cache integrity."""

import hashlib
import os

import pytest
import torch

from meshrl.models import provision
from meshrl.models.packaged import gguf_path


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow  # ~20 s: converts the packaged GGUF again (setup already converted it once)
def test_gguf_conversion_matches_direct_gguf_load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted_dir = provision.prepare("smollm2-135m-instruct")
    converted = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.bfloat16)
    src = gguf_path()
    # loaded in bf16 (not loaded in float32 and cast: a cast also rounds the rotary `inv_freq` buffers to
    # bf16, which moves the logits by up to ~1 and flips greedy choices on some CPUs)
    direct = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.bfloat16)
    # same weights, bit for bit, once the dequantised GGUF is rounded to bf16
    conv_sd, direct_sd = converted.state_dict(), direct.state_dict()
    assert set(conv_sd) == set(direct_sd)
    for name, tensor in direct_sd.items():
        assert torch.equal(conv_sd[name], tensor), name
    tok = AutoTokenizer.from_pretrained(converted_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 21 + 34?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, direct(ids).logits)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    out_converted = converted.generate(ids, **kwargs)
    out_direct = direct.generate(ids, **kwargs)
    assert out_converted.shape[1] > ids.shape[1]
    assert torch.equal(out_converted, out_direct)


def test_tiny_model_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    provision._build_tiny(a)
    provision._build_tiny(b)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(a)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (2, 128, 49152)
    tok = AutoTokenizer.from_pretrained(a)
    packaged = AutoTokenizer.from_pretrained(provision.prepare("smollm2-135m-instruct"))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == packaged.apply_chat_template(msgs, tokenize=False)


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """A cache root in tmp with one cheap builder registered, to exercise the cache machinery."""
    monkeypatch.setenv(provision.CACHE_ENV, str(tmp_path))
    builds = []

    def builder(out):
        builds.append(out)
        (out / "config.json").write_text("{}")
        (out / "weights.bin").write_bytes(os.urandom(4096))

    monkeypatch.setitem(provision.BUILDERS, "fake", (builder, "test"))
    return tmp_path, builds


def test_cache_entry_is_built_once_and_reused(fake_cache):
    root, builds = fake_cache
    first = provision.prepare("fake")
    second = provision.prepare("fake")
    assert first == second == root / "fake"
    assert len(builds) == 1
    assert provision.check_entry(first, full=True) == (True, "ok")
    assert not [p for p in root.iterdir() if p.name.startswith(".fake.")], "temp dir left behind"


@pytest.mark.parametrize("damage", ["truncate", "remove_marker", "flip_byte"])
def test_half_written_or_corrupt_cache_is_rebuilt(fake_cache, damage):
    root, builds = fake_cache
    entry = provision.prepare("fake")
    weights = entry / "weights.bin"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
        verify = False
    elif damage == "remove_marker":
        (entry / provision.MARKER).unlink()
        verify = False
    else:
        data = bytearray(weights.read_bytes())
        data[7] ^= 0xFF
        weights.write_bytes(bytes(data))
        verify = True  # same size: only a full re-hash sees it
    ok, reason = provision.check_entry(entry, full=verify)
    assert not ok and reason
    provision.prepare("fake", verify=verify)
    assert len(builds) == 2
    assert provision.check_entry(entry, full=True) == (True, "ok")


def test_resolve_model_accepts_local_dirs_and_rejects_others(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert provision.resolve_model(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(FileNotFoundError, match="not a known name"):
        provision.resolve_model(str(tmp_path / "missing"))
