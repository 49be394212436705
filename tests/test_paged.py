"""Paged caches: the host's page pool, the paged target and drafter caches, the engine on them (lossless,
waiting for pages, refusing what can never fit), and the precision of a bf16 engine's programs."""

import glob
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_jax import engine as eng
from dspark_jax.cache.pages import PagePool, pages_for
from dspark_jax.decoding import plain_generate
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import (LlamaConfig, LlamaModel, decode_step, forward_packed, init_cache,
                                     init_paged_cache, init_random_weights, prefill)
from tests.helpers import assert_follows_law, count_compilations
from tests.test_engine import POLICIES, SPS, exact_joint, make_drafter, make_model, prompts


# ---------------------------------------------------------------------------------------------------- the pool
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.booleans()), max_size=40), st.booleans())
def test_pages_are_held_once_and_never_lost(ops, contiguous):
    pool = PagePool(num_pages=16 if contiguous else 9, page_size=4, num_slots=4, pages_per_slot=4,
                    contiguous=contiguous)
    for slot, tokens, release in ops:
        tokens = min(tokens, 16)
        if release:
            pool.release(slot)
        elif not pool.held[slot] and not pool.reserved[slot]:
            if pool.reserve(slot, tokens):
                pool.ensure(slot, tokens // 2)
        elif pages_for(tokens, 4) <= pool.reserved[slot]:
            pool.ensure(slot, tokens)
        pool.check()
        for s in range(4):  # a slot's pages back its positions in order, distinct from every other slot's
            assert len(set(pool.block_tables[s, : pool.held[s]].tolist())) == pool.held[s]


def test_reservations_hold_pages_back_and_release_gives_them_back():
    pool = PagePool(num_pages=6, page_size=4, num_slots=3, pages_per_slot=6)
    assert pool.reserve(0, 16)  # 4 pages promised, none allocated yet
    assert pool.used_pages == 0 and pool.free_pages == 2
    assert not pool.reserve(1, 12)  # 3 pages: only 2 not promised
    assert pool.reserve(1, 8)
    pool.ensure(0, 16)
    with pytest.raises(RuntimeError, match="past its reservation"):
        pool.ensure(1, 20)  # 5 pages: 3 past its 2, and nothing is free
    pool.release(0)
    assert pool.free_pages == 4 and pool.used_pages == 0
    with pytest.raises(ValueError, match="a slot holds at most 6"):
        pool.reserve(2, 25)
    pool.check()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 12), st.integers(0, 2)),
                min_size=1, max_size=30),
       st.integers(7, 14))
def test_prefix_cache_shares_only_pages_of_the_same_prefix_and_never_loses_one(requests, num_pages):
    """Requests whose prompts start with one of three shared prefixes come and go on a small pool: an attached
    page always holds exactly the tokens the request would have written there, pages are counted by
    references, cached pages are evicted oldest first when the pool runs short, and nothing is lost."""
    ps, slots = 4, 3
    pool = PagePool(num_pages=num_pages, page_size=ps, num_slots=slots, pages_per_slot=8, prefix_caching=True)
    prefixes = [[1] * 9, [1] * 8 + [2] * 4, [3] * 6]
    content: dict[int, list[int]] = {}  # page -> the tokens written into it (the device's contents, simulated)
    live: dict[int, list[int]] = {}  # slot -> its tokens
    for slot, prefix, tail, extra in requests:
        slot %= slots
        if slot in live:  # the request ends: its full pages stay cached
            pool.publish(slot, live.pop(slot))
            pool.release(slot)
            pool.check()
            continue
        prompt = prefixes[prefix] + [9 + prefix] * tail
        shared = pool.lookup(prompt)
        assert len(shared) * ps < len(prompt)  # at least one token is left to compute
        for j, page in enumerate(shared):  # what the request reads there is what it would have written
            assert content[page] == prompt[j * ps:(j + 1) * ps]
        if not pool.reserve(slot, len(prompt) + extra, shared=shared):
            continue
        pool.attach(slot, shared)
        pool.ensure(slot, len(prompt) + extra)
        tokens = prompt + [20 + extra] * extra
        for j in range(len(shared), pages_for(len(tokens), ps)):  # the request writes its own pages
            content[int(pool.block_tables[slot, j])] = tokens[j * ps:(j + 1) * ps]
        pool.publish(slot, tokens)
        live[slot] = tokens
        pool.check()
    for slot in list(live):
        pool.release(slot)
    pool.check()
    assert pool.used_pages == 0 and pool.free_pages == num_pages


def test_cached_pages_are_evicted_least_recently_used_first():
    pool = PagePool(num_pages=4, page_size=2, num_slots=1, pages_per_slot=4, prefix_caching=True)
    for prompt in ([1, 1, 5], [2, 2, 5], [3, 3, 5]):  # each leaves one published page cached
        assert pool.reserve(0, 4, shared=pool.lookup(prompt))
        pool.ensure(0, 4)
        pool.publish(0, prompt)
        pool.release(0)
    assert pool.cached_pages == 3 and pool.free_pages == 4
    assert pool.lookup([1, 1, 5]) and pool.lookup([3, 3, 5])
    assert pool.reserve(0, 8) and pool.ensure(0, 8)  # needs all 4 pages: one free, then the oldest cached ones
    assert pool.evictions == 3 and not pool.lookup([1, 1, 5]) and not pool.lookup([3, 3, 5])
    pool.release(0)
    pool.check()
    with pytest.raises(ValueError, match="contiguous"):
        PagePool(num_pages=4, page_size=2, num_slots=1, pages_per_slot=4, contiguous=True, prefix_caching=True)


# ---------------------------------------------------------------------------------------------------- the model
def _shuffled_pool(cfg, slots, pages_per_slot, page_size, seed=0):
    rng = np.random.default_rng(seed)
    order = rng.permutation(slots * pages_per_slot + 3).astype(np.int32)  # spare pages: ids past the tables
    tables = order[: slots * pages_per_slot].reshape(slots, pages_per_slot)
    return init_paged_cache(cfg, slots, num_pages=len(order), page_size=page_size, pages_per_slot=pages_per_slot,
                            block_tables=tables)


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_cache_computes_what_the_slot_cache_does(page_size):
    cfg = LlamaConfig.tiny()
    w = init_random_weights(cfg, jax.random.key(0), scale=0.3)
    dense, paged = init_cache(cfg, 3, 64), _shuffled_pool(cfg, 3, 64 // page_size, page_size)
    rng = np.random.default_rng(1)
    for slot, n in ((0, 13), (2, 7), (1, 16)):  # prefill three prompts (chunks of 16: padding rows in one)
        tokens = np.zeros(16, np.int32)
        tokens[:n] = rng.integers(0, 64, n)
        out_d = prefill(w, dense, tokens, jnp.int32(slot), jnp.int32(0), jnp.int32(n), cfg)
        out_p = prefill(w, paged, tokens, jnp.int32(slot), jnp.int32(0), jnp.int32(n), cfg)
        dense, paged = out_d[2], out_p[2]
        np.testing.assert_allclose(out_p[0], out_d[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(paged.lengths, dense.lengths)
    # a decode step of every slot, then a packed verification of 1 + 4 + 2 tokens over the slot grid
    tok = jnp.asarray(rng.integers(0, 64, 3), jnp.int32)
    ld, _, dense = decode_step(w, dense, tok, jnp.ones(3, bool), cfg)
    lp, _, paged = decode_step(w, paged, tok, jnp.ones(3, bool), cfg)
    np.testing.assert_allclose(lp, ld, rtol=1e-5, atol=1e-5)
    slots = jnp.array([0, 1, 1, 1, 1, 2, 2, 0], jnp.int32)
    lens = np.asarray(dense.lengths)
    pos = jnp.asarray([lens[0], lens[1], lens[1] + 1, lens[1] + 2, lens[1] + 3, lens[2], lens[2] + 1, 0], jnp.int32)
    valid = jnp.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
    toks = jnp.asarray(rng.integers(0, 64, 8), jnp.int32)
    for context in (None, 32):
        for rows in (None, jnp.array([1, 2, 0], jnp.int32)):
            d_out = forward_packed(w, jax.tree.map(jnp.copy, dense), toks, slots, pos, valid, cfg, 4, rows, context)
            p_out = forward_packed(w, jax.tree.map(jnp.copy, paged), toks, slots, pos, valid, cfg, 4, rows, context)
            np.testing.assert_allclose(p_out[0][:7], d_out[0][:7], rtol=1e-5, atol=1e-5)
    per_token = forward_packed(w, paged, toks, slots, pos, valid, cfg)  # every token its own sequence
    np.testing.assert_allclose(per_token[0][:7], d_out[0][:7], rtol=1e-5, atol=1e-5)
    for s in range(3):  # the written entries read back alike
        at = jnp.arange(int(lens[s]))
        for a, b in zip(per_token[2].read(s, at), d_out[2].read(s, at)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_paged_drafter_cache_drafts_what_the_slot_cache_does():
    model = make_model()
    d = make_drafter(model, block=4)
    S, C, ps = 3, 32, 8
    tables = np.random.default_rng(2).permutation(S * C // ps).astype(np.int32).reshape(S, C // ps)
    dense = dr.init_drafter_cache(d.cfg, S, C)
    paged = dr.init_paged_drafter_cache(d.cfg, S * C // ps, ps)
    taps = jax.random.normal(jax.random.key(3), (20, len(model.cfg.tap_layers), model.cfg.dim))
    slots = jnp.asarray(np.repeat([0, 1, 2, 1], 5), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(5), np.arange(5), np.arange(5), np.arange(5, 10)]), jnp.int32)
    valid = jnp.ones(20, bool).at[19].set(False)
    dense = dr.write_context(d, dense, taps, slots, positions, valid)
    paged = dr.write_context(d, paged, taps, slots, positions, valid, jnp.asarray(tables))
    ctx_len, anchors = jnp.array([5, 9, 5], jnp.int32), jnp.array([3, 4, 5], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    args = (ctx_len, anchors, keys, jnp.float32(1.0), model.weights.embed, dr.draft_head_weights(d, model.weights.embed))
    for rows in (None, jnp.array([2, 0, 1], jnp.int32)):
        lens = ctx_len if rows is None else ctx_len[rows]
        a = dr.draft(d, dense, rows, lens, *args[1:], context=16)
        b = dr.draft(d, paged, rows, lens, *args[1:], context=16, block_tables=jnp.asarray(tables))
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a[2], b[2], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- the engine
def paged_config(**kw):
    return eng.EngineConfig(**{"num_slots": 3, "capacity": 64, "kv_layout": "pages", "block_size": 8, **kw})


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_on_pages_equals_plain_decoding_while_requests_wait_for_pages(model, drafter, policy):
    ps = prompts(9)
    budgets = [3, 12, 7, 1, 15, 9, 4, 12, 2]
    stop = [5]
    ref = [plain_generate(model, [p], b, 0.0, num_slots=1, stop_ids=stop, capacity=64)[0][0].output_ids
           for p, b in zip(ps, budgets)]
    # 8 pages of 8 tokens: at most two or three of these requests hold their budgets at once; the third slot
    # waits for pages as often as for a slot
    e = eng.Engine(model, drafter, policy, paged_config(num_pages=8), sps=SPS, stop_ids=stop)
    ids = [e.submit(p, b) for p, b in zip(ps, budgets)]
    waited = False
    while not e.idle():
        waited |= bool(e.pending) and (e.slot_request < 0).any()
        e.step()
        e.pages.check()
    for i, r in zip(ids, ref):
        assert e.requests[i].output_ids == r
    assert waited
    assert e.pages.used_pages == 0 and e.pages.free_pages == 8  # every page given back


@pytest.mark.parametrize("policy", ["fixed:2", "dspark"])
def test_sampled_output_on_pages_follows_the_target(policy):
    model = make_model(vocab=4, scale=0.15, seed=1)
    d, prompt = make_drafter(model, seed=2, block=3), [1, 2, 3, 1]
    law = exact_joint(model, prompt, 3, 4)
    e = eng.Engine(model, d, policy, eng.EngineConfig(num_slots=16, capacity=32, temperature=1.0, seed=11,
                                                      kv_layout="pages", block_size=4),
                   sps=np.linspace(10, 4, 64).astype(np.float32), stop_ids=[])
    out = e.run([prompt] * 1500, 3)
    assert_follows_law([c.output_ids for c in out], law)
    assert e.summary()["drafts_per_request"] > 0


def test_a_request_the_pool_can_never_hold_is_refused_before_it_queues(model, drafter):
    e = eng.Engine(model, drafter, "fixed:2", paged_config(num_pages=3), stop_ids=[])
    with pytest.raises(ValueError, match="pages of 8 tokens .* the pool has 3: raise num_pages"):
        e.submit(list(range(1, 20)), 10)  # 19 + 10 + 5 = 34 tokens: 5 pages
    assert not e.pending
    with pytest.raises(ValueError, match="kv_layout"):
        eng.EngineConfig(kv_layout="paged")


def test_no_recompilation_on_pages_after_warm_up(model, drafter):
    e = eng.Engine(model, drafter, "dspark", paged_config(num_slots=4), sps=SPS, stop_ids=[5])
    e.warm_up(20)
    with count_compilations() as n:
        e.run(prompts(6, seed=4), 20)
    assert n() == 0


def test_auto_layout_is_slots_on_a_cpu_and_pages_on_accelerators():
    cfg = eng.EngineConfig()
    assert cfg.layout_for("cpu", 1) == "slots" and cfg.layout_for("cpu", 8) == "slots"
    assert cfg.layout_for("gpu", 1) == "pages" and cfg.layout_for("tpu", 1) == "pages"
    assert cfg.layout_for("gpu", 8) == "pages"  # a mesh: the pool split over tensor, replicated over data
    assert eng.EngineConfig(kv_layout="pages").layout_for("cpu", 8) == "pages"


# ---------------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("layout", ["slots", "pages"])
def test_a_bf16_engine_never_casts_a_cache_or_the_lm_head_to_float32(tmp_path, layout):
    """The programs a bf16 engine lowers (prefill, draft, verification) hold no bf16 -> float32 convert of an
    operand the size of a cache layer or of the [D, V] LM head: products take them as bf16 operands with float32
    accumulation (``preferred_element_type``)."""
    cfg = LlamaConfig.tiny(vocab_size=512, tie_embeddings=False)  # [D, V] = 32 x 512 = 16384 elements
    target = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0), jnp.bfloat16))
    d = make_drafter(target, block=4)
    S, C = 2, 256  # one slot layer of the cache: 2 x 2 heads x 8 x 256 = 8192 elements; a page pool the same
    smallest = min(S * cfg.n_kv_heads * cfg.head_dim * C, cfg.dim * cfg.vocab_size)
    dump = tmp_path / "ir"
    jax.config.update("jax_dump_ir_to", str(dump))
    try:
        e = eng.Engine(target, d, "fixed:3", eng.EngineConfig(num_slots=S, capacity=C, kv_layout=layout),
                       stop_ids=[])
        e.run([[1, 2, 3], [4, 5, 6, 7]], 10)
    finally:
        jax.config.update("jax_dump_ir_to", "")
    convert = re.compile(r"stablehlo\.convert[^\n]*\(tensor<([0-9x]+)xbf16>\) -> tensor<[0-9x]+xf32>")
    programs = [f for f in glob.glob(str(dump / "*.mlir"))
                if re.search(r"(verify_and_commit|draft_and_schedule|prefill)", os.path.basename(f))]
    assert len(programs) >= 3
    big = {(os.path.basename(f), m.group(1)) for f in programs for m in convert.finditer(open(f).read())
           if np.prod([int(x) for x in m.group(1).split("x")]) >= smallest}
    assert not big, f"float32 copies of cache- or LM-head-sized operands: {sorted(big)}"


# ---------------------------------------------------------------------------------------------------- mixed steps
@pytest.mark.parametrize("layout", ["slots", "pages"])
@pytest.mark.parametrize("policy", ["none", "fixed:3", "dspark"])
def test_prompts_prefilled_within_the_step_budget_keep_streams_decoding_and_exact(model, drafter, policy, layout):
    """A burst of long prompts joins two decoding streams under a budget of 24 tokens a step: every step runs
    the streams' round and prefills at most what the budget leaves, and every answer equals plain decoding."""
    rng = np.random.default_rng(5)
    short = [rng.integers(1, 64, 4).tolist() for _ in range(2)]
    burst = [rng.integers(1, 64, n).tolist() for n in (40, 33, 45)]
    stop = [5]
    ref = [plain_generate(model, [p], b, 0.0, num_slots=1, stop_ids=stop, capacity=96)[0][0].output_ids
           for p, b in zip(short + burst, [40, 40, 8, 8, 8])]
    cfg = eng.EngineConfig(num_slots=4, capacity=96, kv_layout=layout, block_size=8, max_num_batched_tokens=24)
    e = eng.Engine(model, drafter, policy, cfg, sps=SPS, stop_ids=stop)
    ids = [e.submit(p, 40) for p in short]
    e.step()
    e.step()
    ids += [e.submit(p, 8) for p in burst]
    steps = []
    while not e.idle():
        streams = [i for i in ids[:2] if i not in e.finished_ids]
        before = {i: len(e.requests[i].output_ids) for i in streams}
        decoding = int((e.slot_request >= 0).sum()) - len(e.prefilling)
        st = e.step().stats
        steps.append(st)
        assert st is not None and st.prefilled <= 24 - decoding
        # a running stream emits in every step while the burst prefills
        assert all(len(e.requests[i].output_ids) > before[i] for i in streams)
    assert sum(st.prefilled for st in steps) == sum(map(len, burst))
    assert max(st.prefilled for st in steps) > 0 and len([st for st in steps if st.prefilled]) >= 6
    for i, r in zip(ids, ref):
        assert e.requests[i].output_ids == r
    with pytest.raises(ValueError, match="max_num_batched_tokens: expected None or an integer >= num_slots"):
        eng.EngineConfig(num_slots=4, max_num_batched_tokens=16)
