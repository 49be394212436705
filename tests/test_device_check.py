"""The memory plan, model shape presets and the accelerator check (dry run and the tiny run on this CPU)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import device_check
from dspark_jax.cache.plan import drafter_param_bytes, kv_bytes_per_token, plan_memory, target_bytes
from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.models.llama import LlamaConfig, init_random_weights
from dspark_jax.models.presets import draft_shape, target_shape
from profiling import accelerator_check


def test_qwen3_8b_on_an_80_gib_device_plans_300k_tokens_with_the_drafter(tmp_path):
    out = tmp_path / "plan.json"
    accelerator_check.main(["--dry-run", "--target-shape", "qwen3-8b", "--draft-shape", "dspark-qwen3-8b",
                            "--device-memory-gib", "80", "--gpu-memory-utilization", "0.9", "--json", str(out)])
    plan = json.loads(out.read_text())
    assert {"weights_bytes", "drafter_bytes", "kv_bytes_per_token", "kv_pool_tokens"} <= set(plan)
    # Qwen3-8B: 36 layers x 8 KV heads x 128 x (K, V) x 2 bytes; the drafter: 5 layers of the same
    assert plan["kv_bytes_per_token"] == 36 * 8 * 128 * 2 * 2 + 5 * 8 * 128 * 2 * 2
    assert 16.0e9 < plan["weights_bytes"] < 16.8e9  # 8.2 B parameters in bf16
    assert plan["kv_pool_tokens"] >= 300_000
    budget = 80 * 2**30 * 0.9
    used = plan["weights_bytes"] + plan["drafter_bytes"] + plan["workspace_bytes"] + plan["kv_pool_bytes"]
    assert used <= budget < used + plan["block_size"] * plan["kv_bytes_per_token"]


def test_shapes_counted_from_eval_shape_equal_real_arrays():
    cfg = LlamaConfig.tiny(tie_embeddings=False, qk_norm=True)
    w = init_random_weights(cfg, jax.random.key(0), jnp.float32)
    assert target_bytes(cfg, jnp.float32) == sum(x.nbytes for x in jax.tree.leaves(w))
    dcfg = DrafterConfig.for_target(cfg, n_layers=1, block=4, rank=8)
    from flax import nnx
    state = nnx.state(Drafter(dcfg, rngs=nnx.Rngs(0)))
    assert drafter_param_bytes(dcfg, jnp.float32) == sum(x.nbytes for x in jax.tree.leaves(state))
    assert kv_bytes_per_token(cfg, dcfg, jnp.bfloat16) == (2 + 1) * 2 * 8 * 2 * 2


def test_the_drafter_shares_the_targets_embedding_and_lm_head():
    import dataclasses
    shared = draft_shape("dspark-qwen3-8b")
    copies = dataclasses.replace(shared, own_embeddings=True)
    # its own copies would add the [V, D] embedding and the [D, V] LM head, in bf16
    assert drafter_param_bytes(copies) - drafter_param_bytes(shared) == 2 * 151936 * 4096 * 2


def test_a_pool_too_small_for_one_request_is_refused_by_name():
    with pytest.raises(ValueError, match="max_model_len 8192"):
        plan_memory(target_shape("qwen3-8b"), draft_shape("dspark-qwen3-8b"), device_memory_bytes=20 * 2**30)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_memory(LlamaConfig.tiny(), None, device_memory_bytes=2**30, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="target shape 'qwen9'"):
        target_shape("qwen9")


def test_dry_run_needs_the_device_memory(capsys):
    with pytest.raises(SystemExit):
        accelerator_check.main(["--dry-run"])
    assert "--device-memory-gib" in capsys.readouterr().err


@pytest.mark.slow
def test_the_tiny_check_runs_every_measurement_and_writes_its_report(tmp_path):
    accelerator_check.main(["--tiny", "--out", str(tmp_path), "--device-memory-gib", "1", "--kv-layout", "pages"])
    result = json.loads((tmp_path / "cpu-tiny.json").read_text())
    report = (tmp_path / "cpu-tiny.md").read_text()
    assert result["plan"]["kv_pool_tokens"] > 0
    assert result["copy_bandwidth_gb_s"] > 0 and result["compiles"] > 0 and result["compile_seconds"] > 0
    kinds = {(r["kind"], r["slots"]) for r in result["target_steps"]}
    assert kinds == {("decode", 1), ("decode", 2), ("verify", 1), ("verify", 2)}
    assert all(np.isfinite(r["of_bandwidth_floor"]) and r["of_bandwidth_floor"] > 0 for r in result["target_steps"])
    assert {r["round"] for r in result["round_prices"]} == {"round none", "round fixed:3"}
    assert result["sps_table"]["points"]
    assert "## Target steps against the floors" in report and "Quick SPS table" in report
    assert result["kv_layout"] == "pages" and "pages KV caches" in report
