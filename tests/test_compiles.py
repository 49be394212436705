"""Few programs: the attention reads the caches in parts up to the longest context (an array, not a static
window), so one program serves every context; a long serving run compiles a bounded set of programs, all of them
in warm-up."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import engine as eng
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import (KVCache, LlamaConfig, context_plan, forward_packed, init_paged_cache,
                                     init_random_weights, prefill)
from dspark_jax.timing import compile_count
from tests.helpers import synthetic_cost_table
from tests.test_engine import make_drafter, make_model

# ---------------------------------------------------------------------------------------------------- the parts


def test_context_plan():
    assert context_plan(8192) == (128, 512, (128, 256, 384, 512))
    assert context_plan(640) == (128, 512, (128, 256, 384, 512))
    assert context_plan(64) == (64, 64, (64,))  # one part: no loop, no switch
    assert context_plan(200) == (128, 128, (128,))
    assert context_plan(96, unit=16) == (96, 96, (96,))
    assert context_plan(8192, unit=48) == (144, 432, (144, 288, 432))


def _random_kv(cfg, slots, capacity, seed):
    rng = np.random.default_rng(seed)
    shape_k, shape_v = (slots, cfg.n_kv_heads, cfg.head_dim, capacity), (slots, cfg.n_kv_heads, capacity, cfg.head_dim)
    return (tuple(jnp.asarray(rng.normal(size=shape_k), jnp.float32) for _ in range(cfg.n_layers)),
            tuple(jnp.asarray(rng.normal(size=shape_v), jnp.float32) for _ in range(cfg.n_layers)))


def _as_pages(k, v, page_size, seed):
    """The same K/V in a shuffled page pool: (pages per layer, block tables)."""
    S, K, E, C = k[0].shape
    n = C // page_size
    tables = np.random.default_rng(seed).permutation(S * n + 2).astype(np.int32)[: S * n].reshape(S, n)
    pools = []
    for kl, vl in zip(k, v):
        kv = jnp.stack([jnp.moveaxis(kl, -1, 1), jnp.moveaxis(vl, 2, 1)], axis=3)  # [S, C, K, 2, E]
        kv = kv.reshape(S, n, page_size, 2 * K, E)
        pool = jnp.zeros((S * n + 2, page_size, 2 * K, E), jnp.float32).at[tables.reshape(-1)].set(
            kv.reshape(S * n, page_size, 2 * K, E))
        pools.append(pool)
    return tuple(pools), jnp.asarray(tables)


@pytest.mark.parametrize("capacity", [640, 1100])
def test_attention_in_parts_equals_one_window(capacity):
    """Verification (grid of all slots, of some rows, per token) and prefill over contexts that end in different
    parts (the head, the loop's chunks, a tail clamped at a capacity that no part size divides), on the slot cache
    and on a page pool: read in parts up to the longest context, they give what one static window gives."""
    cfg = LlamaConfig.tiny()
    w = init_random_weights(cfg, jax.random.key(0), scale=0.3)
    k, v = _random_kv(cfg, 3, capacity, seed=capacity)
    pages, tables = _as_pages(k, v, 4, seed=1)
    for lens in ([5, capacity - 10, 600], [100, 300, 508], [520, 1, 130]):
        dense = KVCache(k, v, jnp.asarray(lens, jnp.int32))
        paged = init_paged_cache(cfg, 3, num_pages=pages[0].shape[0], page_size=4, pages_per_slot=capacity // 4,
                                 block_tables=tables).replace(pages=pages, lengths=dense.lengths)
        toks, slots = np.array([1, 2, 3, 4, 5, 6, 0, 0]), np.array([0, 0, 1, 2, 2, 2, 0, 0])
        pos = np.array([lens[0], lens[0] + 1, lens[1], lens[2], lens[2] + 1, lens[2] + 2, 0, 0])
        args = [jnp.asarray(x) for x in (toks, slots, pos, np.arange(8) < 6)]
        for per_slot, rows in ((4, None), (4, jnp.array([2, 0, 1])), (None, None)):
            want, _, _ = forward_packed(w, jax.tree.map(jnp.copy, dense), *args, cfg, per_slot, rows, capacity)
            for cache in (dense, paged):
                got, _, _ = forward_packed(w, jax.tree.map(jnp.copy, cache), *args, cfg, per_slot, rows)
                np.testing.assert_allclose(got[:6], want[:6], rtol=2e-5, atol=2e-5)
        for start in (0, 492, capacity - 20):
            chunk = (jnp.arange(16) % 60 + 1).astype(jnp.int32)
            at = dict(slot=jnp.int32(1), start=jnp.int32(start), n_valid=jnp.int32(13))
            one = dense.replace(lengths=dense.lengths.at[1].set(start))
            want, _, _ = forward_packed(w, jax.tree.map(jnp.copy, one), chunk, jnp.ones(16, jnp.int32),
                                        start + jnp.arange(16), jnp.arange(16) < 13, cfg, None, None, capacity)
            for sharded in (False, True):
                logits, _, _ = prefill(w, jax.tree.map(jnp.copy, one), chunk, *at.values(), cfg, sharded)
                np.testing.assert_allclose(logits, want[12], rtol=2e-5, atol=2e-5)
            logits, _, _ = prefill(w, jax.tree.map(jnp.copy, paged.replace(lengths=one.lengths)), chunk,
                                   *at.values(), cfg)
            np.testing.assert_allclose(logits, want[12], rtol=2e-5, atol=2e-5)


def test_drafter_context_in_parts_equals_one_window():
    """The drafter's context read in parts up to the longest row (dense and paged, all slots in place and some
    rows gathered) drafts what one static window over the whole capacity drafts."""
    model = make_model()
    d = make_drafter(model, block=4)
    S, C, ps = 3, 1100 // 4 * 4, 4
    rng = np.random.default_rng(0)
    shape = (d.cfg.n_layers, S, C, d.cfg.n_kv_heads, d.cfg.head_dim)
    dense = dr.DrafterCache(k=jnp.asarray(rng.normal(size=shape), jnp.float32),
                            v=jnp.asarray(rng.normal(size=shape), jnp.float32))
    n = C // ps
    tables = rng.permutation(S * n).astype(np.int32).reshape(S, n)
    to_pages = lambda x: jnp.zeros((d.cfg.n_layers, S * n, ps, *shape[3:]), jnp.float32).at[:, tables.reshape(-1)].set(
        x.reshape(d.cfg.n_layers, S * n, ps, *shape[3:]))
    paged = dr.PagedDrafterCache(k=to_pages(dense.k), v=to_pages(dense.v))
    ctx_len, anchors = jnp.array([700, 9, 513], jnp.int32), jnp.array([3, 4, 5], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    head_w = dr.draft_head_weights(d, model.weights.embed)
    run = jax.jit(lambda cache, rows, lens, tables, context: dr.draft(
        d, cache, rows, lens, anchors if rows is None else anchors[rows], keys, jnp.float32(1.0), model.weights.embed,
        head_w, context=context, block_tables=tables), static_argnums=4)
    for rows in (None, jnp.array([2, 0, 1], jnp.int32)):
        lens = ctx_len if rows is None else ctx_len[rows]
        want = run(dense, rows, lens, None, C)
        for cache, tab in ((dense, None), (paged, jnp.asarray(tables))):
            got = run(cache, rows, lens, tab, None)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- the count
BUDGET = 64
_watch = {"limit": None}


class TooManyCompiles(RuntimeError):
    pass


def _on_compile(event: str, duration: float, **kwargs) -> None:
    """Fail fast once a watched block passes its compile budget (an engine that compiles per window would
    otherwise compile thousands of programs before the assertion)."""
    if event == "/jax/core/compile/backend_compile_duration" and _watch["limit"] is not None:
        if compile_count() > _watch["limit"]:
            _watch["limit"] = None
            raise TooManyCompiles(f"more than {BUDGET} programs compiled")


jax.monitoring.register_event_duration_secs_listener(_on_compile)


def test_a_serving_run_to_the_capacity_compiles_at_most_64_programs_all_in_warm_up():
    """64 slots of 8192 positions (dspark with a cost model, greedy and sampled requests): building the engine,
    warming it up and a run whose contexts grow to the capacity (long prompts prefilled chunk by chunk within the
    step budget next to short requests) compile at most 64 programs, jax's own count, and none after warm-up."""
    model = make_model()
    d = make_drafter(model)
    S, C = 64, 8192
    start = compile_count()
    _watch["limit"] = start + BUDGET
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the small synthetic table is shorter than 64 slots' rounds
            e = eng.Engine(model, d, "dspark", eng.EngineConfig(num_slots=S, capacity=C), sps=synthetic_cost_table(),
                           stop_ids=[])
        rounds = e.warm_up(C - 300)
        warm = compile_count()
        rng = np.random.default_rng(0)
        for i, n in enumerate([C - 300, C // 2, 1000, 700]):  # long prompts: contexts up to C - 300 + 150
            e.submit(rng.integers(1, 64, n).tolist(), 150, eng.SamplingParams(temperature=0.8 * (i % 2), seed=i))
        for i in range(S + 8):  # short ones, more than the slots: joins and leaves at every load
            e.submit(rng.integers(1, 64, int(rng.integers(2, 20))).tolist(), int(rng.integers(2, 40)),
                     eng.SamplingParams(temperature=float(i % 3 == 0)))
        while not e.idle():
            e.step()
    finally:
        _watch["limit"] = None
    assert compile_count() - start <= BUDGET
    assert compile_count() == warm, "programs compiled after warm-up"
    assert rounds == len(e.round_shapes())
    assert max(r.context for r in e.rounds) > C - 300
    assert max(r.active for r in e.rounds) == S and any(r.drafted for r in e.rounds)
