"""The public API: every top-level name is documented with an example that runs, the README's own-loop guide
runs as written, and bad input is refused with a clear message before any long work."""

from __future__ import annotations

import doctest
import inspect
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dspark_jax

README = Path(__file__).resolve().parents[1] / "README.md"


def test_issue_names_are_exported():
    from dspark_jax import Engine, SPSTable, greedy_accept, schedule, speculative_accept, survival_probs  # noqa: F401

    assert sorted(dspark_jax.__all__) == sorted(set(dspark_jax.__all__))
    for name in dspark_jax.__all__:
        assert getattr(dspark_jax, name) is not None, name


@pytest.mark.parametrize("name", dspark_jax.__all__)
def test_public_name_has_docstring_and_doctest(name):
    obj = getattr(dspark_jax, name)
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    module = sys.modules[obj.__module__]
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, module=module, globs=dict(vars(module)))
    examples = [ex for t in tests for ex in t.examples]
    assert examples, f"{name} has no doctest example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{name}: {runner.failures} doctest example(s) failed"


def readme_block(marker: str) -> str:
    """The fenced Python block that follows ``<!-- marker -->`` in the README."""
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"<!-- {re.escape(marker)} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"README has no ```python block after <!-- {marker} -->"
    return m.group(1)


def test_readme_own_loop_runs_as_written():
    """The guide's loop decodes with the scheduler and greedy verification, checks itself against plain greedy
    decoding (an assert in the block), and samples once with speculative_accept."""
    scope: dict = {}
    exec(compile(readme_block("own-loop"), "README own-loop", "exec"), scope)
    assert len(scope["outputs"]) == scope["R"] and min(len(o) for o in scope["outputs"]) >= 24
    assert scope["accepted"].shape == (scope["R"],) and scope["nxt"].shape == (scope["R"],)


# ---------------------------------------------------------------------------------------------- bad input

def test_schedule_contract_inside_jit_nan_and_out_of_range():
    """Inside jit nothing raises: a NaN confidence is never verified (nor what follows it), values above 1
    count as 1; the checked entry point names the problem instead."""
    from dspark_jax import schedule
    from dspark_jax.scheduler import schedule_checked

    sps = jnp.ones(16)
    conf = jnp.array([[0.9, jnp.nan, 0.9], [5.0, 0.9, 0.9]])
    assert schedule(conf, sps).lengths.tolist() == schedule(jnp.array([[0.9, 0.0, 0.9], [1.0, 0.9, 0.9]]),
                                                            sps).lengths.tolist()
    assert int(schedule(conf, sps).lengths[0]) <= 1
    with pytest.raises(ValueError, match="confidences: contains NaN"):
        schedule_checked(conf, sps)
    with pytest.raises(ValueError, match=r"confidences: expected values in \[0, 1\], got 5\.0"):
        schedule_checked(jnp.array([[5.0, 0.9]]), sps)


def test_out_folder_is_probed_for_writing():
    """A folder root may not write to (a read-only file system) is refused before the work starts."""
    from dspark_jax.io import check_writable

    with pytest.raises(ValueError, match=r"cannot write /proc/table\.json: folder /proc is not writable"):
        check_writable("/proc/table.json")
    with pytest.raises(ValueError, match="does not exist"):
        check_writable("/no/such/folder/table.json")


def test_model_path_errors_name_what_was_expected(tmp_path):
    from dspark_jax import load_target

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="for a safetensors checkpoint, pass its folder") as err:
        load_target(weights)
    assert "delete" not in str(err.value).lower()  # never tell a user to delete their own file
    with pytest.raises(ValueError, match="config.json is missing"):
        load_target(tmp_path)


def test_engine_refuses_more_slots_than_one_verification_holds():
    import jax
    from flax import nnx

    from dspark_jax import Engine, EngineConfig
    from dspark_jax.models.drafter import Drafter, DrafterConfig
    from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights

    cfg = LlamaConfig.tiny()
    target = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0)))
    drafter = Drafter(DrafterConfig.for_target(cfg, n_layers=1, ffn_dim=64, rank=8, block=7), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_slots=129 with block 7: a round may verify 1032 tokens.*at most 128"):
        Engine(target, drafter, "fixed:7", EngineConfig(num_slots=129, capacity=64))
    with pytest.raises(ValueError, match="num_slots: expected an integer >= 1"):
        Engine(target, None, "none", EngineConfig(num_slots=0, capacity=64))


def test_prompts_file_turns_must_be_a_list(tmp_path):
    from dspark_jax.data import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": "not a list"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: expected .*a non-empty list of strings"):
        load_prompts([f])
    f.write_text('{"turns": []}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"p\.jsonl:1"):
        load_prompts([f])
