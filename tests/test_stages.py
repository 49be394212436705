"""Stage timing: the weights-only floor against a NumPy reference of the same program, the turn-taking timer,
and the target-step and round-stage tables on a tiny model (their structure and ratios; timings themselves
are not checked: the host is shared)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import stages
from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
from tests.helpers import synthetic_cost_table


@pytest.fixture(scope="module")
def tiny():
    cfg = LlamaConfig.tiny()
    return LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0)))


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_floor(weights, cfg, ids):
    """The floor's program in NumPy: the layers' weight matmuls with q * (k + v) in place of attention."""
    layers = jax.tree.map(lambda a: np.asarray(a, np.float64), weights.layers)
    T, K, H, E = len(ids), cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    x = np.asarray(weights.embed, np.float64)[ids]
    for lw in layers:
        h = np_rms(x, lw.attn_norm, cfg.norm_eps)
        q, k, v = h @ lw.wq, h @ lw.wk, h @ lw.wv
        mixed = q.reshape(T, K, H // K, E) * (k + v).reshape(T, K, 1, E)
        x = x + mixed.reshape(T, H * E) @ lw.wo
        h = np_rms(x, lw.mlp_norm, cfg.norm_eps)
        gate = h @ lw.w_gate
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lw.w_up)) @ lw.w_down
    x = np_rms(x, np.asarray(weights.final_norm, np.float64), cfg.norm_eps)
    return x @ np.asarray(weights.embed, np.float64).T


@pytest.mark.parametrize("T", [1, 5])
def test_weights_only_forward_matches_numpy(tiny, T):
    ids = np.arange(T) * 7 % tiny.cfg.vocab_size
    got = np.asarray(stages.weights_only_forward(tiny.weights, jnp.asarray(ids, jnp.int32), tiny.cfg))
    np.testing.assert_allclose(got, np_floor(tiny.weights, tiny.cfg, ids), rtol=1e-4, atol=1e-4)


def test_interleaved_takes_turns_and_counts():
    calls = []
    thunks = {name: (lambda name=name: calls.append(name) or jnp.zeros(())) for name in ("a", "b", "c")}
    times = stages.interleaved(thunks, repeats=3, warmup=1)
    assert calls == ["a", "b", "c"] + ["a", "b", "c"] * 3  # warm-up of each, then turns
    assert {n: t.repeats for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t.p25 <= t.median <= t.p75 for t in times.values())
    calls.clear()
    stages.interleaved(thunks, repeats=2, warmup=0, burst=2)
    assert calls == ["a", "a", "b", "b", "c", "c"] * 2  # each turn a burst, the last call timed
    with pytest.raises(ValueError, match="repeats >= 1"):
        stages.interleaved(thunks, repeats=0)


def test_interleaved_takes_more_turns_for_fast_programs_within_its_budgets():
    """``min_seconds`` adds turns (up to ``max_repeats``) where the timed calls are short; ``max_seconds`` stops
    a slow group early, keeping three turns. Each thunk sleeps 10 ms, so every bound below is exact."""
    sleepy = {n: (lambda: time.sleep(0.01) or jnp.zeros(())) for n in ("a", "b")}
    assert {t.repeats for t in stages.interleaved(sleepy, repeats=2, warmup=0).values()} == {2}
    got = stages.interleaved(sleepy, repeats=2, warmup=0, min_seconds=5.0, max_repeats=6)
    assert {t.repeats for t in got.values()} == {6}  # 6 turns of ~20 ms stay far below 5 s
    got = stages.interleaved(sleepy, repeats=10, warmup=0, max_seconds=0.05)
    assert {t.repeats for t in got.values()} == {3}  # past 50 ms after three turns of >= 20 ms
    with pytest.raises(ValueError, match="max_repeats >= repeats"):
        stages.interleaved(sleepy, repeats=4, max_repeats=2)
    with pytest.raises(ValueError, match="min_seconds >= 0"):
        stages.interleaved(sleepy, min_seconds=-1.0)


def test_target_step_rows_pair_each_step_with_the_floor(tiny):
    rows = stages.target_step_rows(tiny.weights, tiny.cfg, slots=(2,), contexts=(20,), per_slot=(1, 4), repeats=1,
                                   burst=1)
    assert [(r["kind"], r["slots"], r["per_slot"], r["tokens"], r["window"]) for r in rows] == [
        ("decode", 2, 1, 2, 128), ("verify", 2, 4, 8, 128)]
    for r in rows:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0
        np.testing.assert_allclose(r["ratio"], r["step_ms"] / r["floor_ms"], rtol=1e-12)


def test_round_stage_rows_cover_every_stage(tiny):
    drafter = Drafter(DrafterConfig.for_target(tiny.cfg, n_layers=1, ffn_dim=64, rank=8, block=3), rngs=nnx.Rngs(0))
    rows = stages.round_stage_rows(tiny, drafter, users=(2,), context=12, verify_tokens=(1, 4), drafts=(3,),
                                   repeats=1, rounds=1, warmup=1, burst=1, sps=synthetic_cost_table(block=3))
    by = {r["stage"]: r for r in rows}
    assert set(by) == {"drafter layers", "LM head", "sequential + confidence heads", "confidence head",
                       "draft program", "schedule", "context write", "host round trip", "verify 1", "verify 4",
                       "floor 2", "floor 8", "round none", "round fixed:3", f"round {stages.SHUT_GATE}"}
    assert by[f"round {stages.SHUT_GATE}"]["tokens"] == 2 and by[f"round {stages.SHUT_GATE}"]["ms"] > 0
    assert by["round none"]["of_plain_round"] == 1.0 and by["floor 2"]["of_floor"] == 1.0
    assert (by["round none"]["tokens"], by["round fixed:3"]["tokens"]) == (2, 8)
    plain = by["round none"]["ms"]
    np.testing.assert_allclose(by["verify 4"]["of_plain_round"], by["verify 4"]["ms"] / plain, rtol=1e-12)
    rest = by["round fixed:3"]["ms"] - by["verify 4"]["ms"] - by["draft program"]["ms"] - by["schedule"]["ms"] \
        - by["context write"]["ms"]
    np.testing.assert_allclose(by["round fixed:3"]["rest_ms"], rest, rtol=1e-9)
