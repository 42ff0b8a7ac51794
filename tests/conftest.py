import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer and chat template (from the packaged GGUF)."""
    from meshrl.models.packaged import packaged_tokenizer

    return packaged_tokenizer()
