"""The Llama target: forward against a NumPy reference (tiny random model) and against transformers (real GGUF),
the KV cache semantics of prefill / decode / packed verification, and recompilation guards."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import decoding
from dspark_jax.models import llama
from dspark_jax.models.llama import (
    first_argmax,
    KVCache, LlamaConfig, LlamaModel, bucket_for, commit, decode_step, default_tap_layers, forward_packed,
    init_cache, init_random_weights, logits_from_hidden, masked_softmax, prefill_prompt,
)
from tests.helpers import count_compilations

# ----------------------------------------------------------------------------------------------------
# An independent NumPy reference: the whole sequence at once, float64, no cache, RoPE as complex rotation.


def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_rope(x, pos, base):  # x [n, heads, E]; pairs (i, i + E/2) rotate by pos * base^(-2i/E)
    half = x.shape[-1] // 2
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * pos[:, None, None] * base ** (-np.arange(half) / half))
    return np.concatenate([z.real, z.imag], -1)


def np_forward(weights, cfg: LlamaConfig, ids):
    """Causal forward of one sequence: (logits [n, V], layer outputs [L, n, D], final hidden [n, D], keys, values)."""
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), weights)
    ids = np.asarray(ids)
    n, E, Q = len(ids), cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    pos = np.arange(n)
    x = w.embed[ids]
    outs, keys, values = [], [], []
    for l in range(cfg.n_layers):
        h = _np_rms(x, w.layers[l].attn_norm, cfg.norm_eps)
        q = _np_rope((h @ w.layers[l].wq).reshape(n, cfg.n_heads, E), pos, cfg.rope_base)
        k = _np_rope((h @ w.layers[l].wk).reshape(n, cfg.n_kv_heads, E), pos, cfg.rope_base)
        v = (h @ w.layers[l].wv).reshape(n, cfg.n_kv_heads, E)
        keys.append(k), values.append(v)
        s = np.einsum("ihe,jhe->hij", q, np.repeat(k, Q, axis=1)) / np.sqrt(E)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hij,jhe->ihe", p, np.repeat(v, Q, axis=1)).reshape(n, -1) @ w.layers[l].wo
        h = _np_rms(x, w.layers[l].mlp_norm, cfg.norm_eps)
        g = h @ w.layers[l].w_gate
        x = x + (g / (1 + np.exp(-g)) * (h @ w.layers[l].w_up)) @ w.layers[l].w_down
        outs.append(x)
    final = _np_rms(x, w.final_norm, cfg.norm_eps)
    return final @ w.embed.T, np.stack(outs), final, np.stack(keys), np.stack(values)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def entries(cache: KVCache):
    """All K and V entries as NumPy [L, S, C, K, E] (whatever the cache's storage layout)."""
    pos = np.arange(cache.capacity)
    k, v = zip(*(cache.read(s, pos) for s in range(cache.num_slots)))
    return np.stack(k, axis=1), np.stack(v, axis=1)


CFG = LlamaConfig.tiny()


@pytest.fixture(scope="module")
def tiny():
    return init_random_weights(CFG, jax.random.key(0), scale=0.3)


def _prefilled_cache(weights, prefixes, capacity=32):
    cache = init_cache(CFG, len(prefixes), capacity)
    for s, ids in enumerate(prefixes):
        if len(ids):
            _, _, cache = prefill_prompt(weights, cache, ids, s, CFG)
    return cache


# Slot s holds PREFIXES[s] committed; NEW[s] are the tokens to verify (slot 3 gets none: an idle slot).
RNG = np.random.default_rng(0)
PREFIXES = [RNG.integers(0, 64, n).tolist() for n in (5, 0, 9, 6)]
NEW = [RNG.integers(0, 64, n).tolist() for n in (3, 2, 4, 0)]


def _packed_batch(T=16, seed=1):
    """Tokens of NEW interleaved in a random order, then padding whose slots/positions point at live entries."""
    rows = [(t, s, len(PREFIXES[s]) + j) for s in range(4) for j, t in enumerate(NEW[s])]
    order = np.random.default_rng(seed).permutation(len(rows))
    rows = [rows[i] for i in order]
    n = len(rows)
    tokens = np.array([r[0] for r in rows] + [7] * (T - n), np.int32)
    slots = np.array([r[1] for r in rows] + [0, 2, 3, 1, 0, 2, 3][: T - n], np.int32)
    positions = np.array([r[2] for r in rows] + [0, 1, 2, 0, 6, 3, 4][: T - n], np.int32)
    valid = np.arange(T) < n
    return tokens, slots, positions, valid


# ----------------------------------------------------------------------------------------------------
# Small pure pieces


def test_doctests():
    for module in (llama, decoding):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_tap_layers_formula():
    assert default_tap_layers(30) == (1, 8, 14, 20, 27)
    assert LlamaConfig.tiny(n_layers=30).tap_layers == (1, 8, 14, 20, 27)
    # round(1 + i * (L - 4) / 4), clipped below the final layer.
    assert default_tap_layers(8) == (1, 2, 3, 4, 5)
    assert default_tap_layers(2) == (0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="tap_layers"):
        LlamaConfig.tiny(tap_layers=(0, 2))


@pytest.mark.parametrize("n, b", [(1, 1), (3, 4), (8, 8), (9, 16), (15, 16), (16, 16), (17, 32), (1024, 1024)])
def test_bucket_for(n, b):
    assert bucket_for(n) == b


def test_bucket_for_too_many():
    with pytest.raises(ValueError, match="1025 tokens exceed the largest bucket 1024"):
        bucket_for(1025)


def test_masked_softmax_empty_row_is_zero():
    s = jnp.array([[1.0, 2.0, 3.0], [5.0, -1e30, 0.0]])
    m = jnp.array([[True, False, True], [False, False, False]])
    p = np.asarray(jax.jit(masked_softmax)(s, m))
    e = np.exp([1.0, 3.0]) / np.exp([1.0, 3.0]).sum()
    np.testing.assert_allclose(p, [[e[0], 0, e[1]], [0, 0, 0]], rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------------
# Tiny random model: cache semantics against the NumPy reference


@pytest.mark.parametrize("max_per_slot,row_slots,context", [
    (None, None, None), (4, None, None), (6, None, None), (None, None, 16),
    (4, (2, 0, 1), None), (4, (1, 2, 0, 3), 16),  # a subset of the slots, in any order; a context window
])
def test_packed_forward_matches_numpy_reference(tiny, max_per_slot, row_slots, context):
    cache = _prefilled_cache(tiny, PREFIXES)
    before_k, before_v = entries(cache)
    before_lengths = cache.lengths.tolist()
    tokens, slots, positions, valid = _packed_batch()
    if row_slots is not None:
        row_slots = jnp.array(row_slots, jnp.int32)
        slots = np.where(valid, slots, 2)  # padding points at a live slot of the rows
    logits, extras, cache = forward_packed(tiny, cache, tokens, slots, positions, valid, CFG, max_per_slot,
                                           row_slots, context)
    k_now, v_now = entries(cache)
    refs = {s: np_forward(tiny, CFG, PREFIXES[s] + NEW[s]) for s in range(3)}
    for t in np.flatnonzero(valid):
        s, p = slots[t], positions[t]
        ref_logits, ref_outs, ref_final, ref_k, ref_v = refs[s]
        np.testing.assert_allclose(logits[t], ref_logits[p], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(extras.taps[t], ref_outs[list(CFG.tap_layers), p], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(extras.final_hidden[t], ref_final[p], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(k_now[:, s, p], ref_k[:, p], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(v_now[:, s, p], ref_v[:, p], rtol=1e-4, atol=1e-5)
    # Lengths are the caller's to move; nothing but the valid tokens' entries changed (padding wrote nothing).
    assert cache.lengths.tolist() == before_lengths
    written = np.zeros((cache.num_slots, cache.capacity), bool)
    written[slots[valid], positions[valid]] = True
    np.testing.assert_array_equal(k_now[:, ~written], before_k[:, ~written])
    np.testing.assert_array_equal(v_now[:, ~written], before_v[:, ~written])
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("max_per_slot", [None, 4])
def test_packed_equals_each_slot_alone(tiny, max_per_slot):
    cache = _prefilled_cache(tiny, PREFIXES)
    tokens, slots, positions, valid = _packed_batch(T=16)
    packed, packed_extras, packed_cache = forward_packed(tiny, copy(cache), tokens, slots, positions, valid, CFG,
                                                         max_per_slot)
    for s in range(3):
        idx = np.flatnonzero(valid & (slots == s))
        pad = 8 - len(idx)
        alone = (np.concatenate([tokens[idx], np.zeros(pad, np.int32)]),
                 np.concatenate([slots[idx], np.full(pad, s, np.int32)]),
                 np.concatenate([positions[idx], np.zeros(pad, np.int32)]),
                 np.arange(8) < len(idx))
        logits, extras, alone_cache = forward_packed(tiny, copy(cache), *alone, CFG)
        n = len(idx)
        np.testing.assert_allclose(packed[idx], logits[:n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(packed_extras.taps[idx], extras.taps[:n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.stack(packed_cache.k)[:, s], np.stack(alone_cache.k)[:, s], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_per_slot", [None, 2])
def test_rows_with_nothing_visible_give_zeros_not_nan(tiny, max_per_slot):
    cache = _prefilled_cache(tiny, PREFIXES)
    before = copy(cache)
    T = 8
    logits, extras, cache = forward_packed(tiny, cache, jnp.arange(T), jnp.zeros(T, jnp.int32),
                                           jnp.arange(T), jnp.zeros(T, bool), CFG, max_per_slot)
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(cache.k, before.k)
    np.testing.assert_array_equal(cache.v, before.v)


@pytest.mark.parametrize("start", [0, 10])
def test_chunked_prefill_equals_one_shot(tiny, start):
    ids = RNG.integers(0, 64, 40).tolist()
    base = init_cache(CFG, 2, 64)
    if start:
        _, _, base = prefill_prompt(tiny, base, RNG.integers(0, 64, start).tolist(), 1, CFG)
    one_logits, one_extras, one = prefill_prompt(tiny, copy(base), ids, 1, CFG, start=start, chunks=(64,),
                                                 return_extras=True)
    ch_logits, ch_extras, chunked = prefill_prompt(tiny, copy(base), ids, 1, CFG, start=start, chunks=(16,),
                                                   return_extras=True)
    np.testing.assert_allclose(ch_logits, one_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ch_extras.taps, one_extras.taps, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ch_extras.final_hidden, one_extras.final_hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked.k, one.k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked.v, one.v, rtol=1e-5, atol=1e-5)
    assert chunked.lengths.tolist() == one.lengths.tolist() == [0, start + 40]
    # The last logits are the teacher-forced ones of the last prompt token.
    np.testing.assert_allclose(one_logits, logits_from_hidden(tiny, one_extras.final_hidden)[-1], rtol=1e-5)


def test_greedy_decode_through_cache_equals_teacher_forced_argmax(tiny):
    prompts = [RNG.integers(0, 64, n).tolist() for n in (7, 3, 12)]
    cache = init_cache(CFG, 3, 32)
    tokens = np.zeros(3, np.int32)
    for s, p in enumerate(prompts):
        logits, _, cache = prefill_prompt(tiny, cache, p, s, CFG)
        tokens[s] = int(jnp.argmax(logits))
    generated = [[int(t)] for t in tokens]
    active = np.array([True, True, True])
    for step in range(10):
        active[2] = step < 4  # slot 2 stops early: inactive slots must not move
        logits, _, cache = decode_step(tiny, cache, jnp.asarray(tokens), jnp.asarray(active), CFG)
        tokens = np.where(active, np.asarray(jnp.argmax(logits, -1)), tokens).astype(np.int32)
        for s in np.flatnonzero(active):
            generated[s].append(int(tokens[s]))
    assert cache.lengths.tolist() == [len(p) + len(g) - 1 for p, g in zip(prompts, generated)]
    for p, g in zip(prompts, generated):
        seq = p + g
        ref_logits = np_forward(tiny, CFG, seq)[0]
        assert ref_logits[len(p) - 1:-1].argmax(-1).tolist() == g


def test_bfloat16_weights_track_float32(tiny):
    """The bf16 option runs the same computation: bf16 matmuls, float32 norms/softmax/logits."""
    ids = np.random.default_rng(5).integers(0, 64, 20).tolist()
    w16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny)
    _, e32, _ = prefill_prompt(tiny, init_cache(CFG, 1, 32), ids, 0, CFG, return_extras=True)
    _, e16, c16 = prefill_prompt(w16, init_cache(CFG, 1, 32, jnp.bfloat16), ids, 0, CFG, return_extras=True)
    l32, l16 = logits_from_hidden(tiny, e32.final_hidden), logits_from_hidden(w16, e16.final_hidden)
    assert l16.dtype == jnp.float32 and c16.dtype == jnp.bfloat16
    # bf16 keeps 8 bits of mantissa, and the residual stream is stored in bf16: the drift measured here is ~4% of
    # the logit range; 10% still catches a broken computation (whose error is of the order of the range).
    np.testing.assert_allclose(l16, l32, rtol=0, atol=0.1 * float(jnp.abs(l32).max()))


def test_commit_moves_lengths_only(tiny):
    cache = _prefilled_cache(tiny, PREFIXES)
    moved = commit(cache, jnp.array([2, 0, 99]), jnp.array([11, 7, 5]))  # 99: a padded row, ignored
    assert moved.lengths.tolist() == [7, 0, 11, 6]
    assert moved.k is cache.k and moved.v is cache.v


def test_check_packed_rejects_bad_batches(tiny):
    cache = _prefilled_cache(tiny, PREFIXES)
    ok = _packed_batch()
    llama.check_packed(cache, *ok)
    tokens, slots, positions, valid = ok
    with pytest.raises(ValueError, match="slots of valid tokens must lie in"):
        llama.check_packed(cache, tokens, np.where(valid, 4, slots), positions, valid)
    with pytest.raises(ValueError, match="positions of slot 0 must be"):
        llama.check_packed(cache, tokens, slots, np.where(valid & (slots == 0), 1, positions), valid)
    with pytest.raises(ValueError, match="positions must have shape"):
        llama.check_packed(cache, tokens, slots, positions[:3], valid)
    llama.check_packed(cache, *ok, max_per_slot=4)
    with pytest.raises(ValueError, match="slot 2 has 4 valid tokens, more than max_per_slot=3"):
        llama.check_packed(cache, *ok, max_per_slot=3)


def test_step_functions_do_not_recompile(tiny):
    cache = _prefilled_cache(tiny, PREFIXES)
    tokens, slots, positions, valid = _packed_batch()
    _, _, cache = forward_packed(tiny, cache, tokens, slots, positions, valid, CFG)
    _, _, cache = decode_step(tiny, cache, jnp.zeros(4, jnp.int32), jnp.ones(4, bool), CFG)
    _, _, cache = prefill_prompt(tiny, cache, [1, 2, 3], 1, CFG)
    other = (tokens[::-1].copy(), slots, positions + 1, ~valid)  # new values, same shapes (host arrays:
    decode_args = (np.ones(4, np.int32), np.array([True, False, True, False]))  # making them compiles nothing)
    with count_compilations() as n:
        _, _, cache = forward_packed(tiny, cache, *other, CFG)
        _, _, cache = decode_step(tiny, cache, *decode_args, CFG)
        _, _, cache = prefill_prompt(tiny, cache, [4, 5, 6, 7, 8], 2, CFG, start=3)
        jax.block_until_ready(cache)
    assert n() == 0


def test_model_verify_pads_to_bucket(tiny):
    model = LlamaModel(CFG, tiny)
    cache = _prefilled_cache(tiny, PREFIXES)
    tokens, slots, positions, valid = _packed_batch()
    n = int(valid.sum())
    logits, extras, _ = model.verify(copy(cache), tokens[:n], slots[:n], positions[:n], check=True)
    ref, ref_extras, _ = forward_packed(tiny, cache, tokens, slots, positions, valid, CFG)
    assert logits.shape == (n, CFG.vocab_size) and extras.taps.shape == (n, 5, CFG.dim)
    np.testing.assert_allclose(logits, ref[:n], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Plain generation on the tiny model


def test_plain_generate_is_batch_independent_and_greedy_exact(tiny):
    model = LlamaModel(CFG, tiny)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 9, 3, 14, 6)]
    others = [prompts[0]] + [rng.integers(0, 64, len(p)).tolist() for p in prompts[1:]]
    run = lambda ps, seed=3: decoding.plain_generate(model, ps, 12, temperature=1.0, seed=seed, num_slots=3,
                                                     stop_ids=())[0]
    base = run(prompts)
    assert all(len(r.output_ids) == 12 for r in base)
    # Request 0 samples the same tokens whatever shares the batch (keys from seed, request index, position;
    # the rows of a step do not mix). Across different num_slots the matmul kernels may differ in the last bit,
    # so only a fixed slot count is compared bit for bit.
    assert run(others)[0].output_ids == base[0].output_ids
    assert run(prompts, seed=4)[0].output_ids != base[0].output_ids

    greedy, stats = decoding.plain_generate(model, prompts, 10, temperature=0.0, num_slots=2, stop_ids=())
    assert stats.generated_tokens == 50
    for r in greedy:
        ref_logits = np_forward(tiny, CFG, r.prompt_ids + r.output_ids)[0]
        assert ref_logits[len(r.prompt_ids) - 1:-1].argmax(-1).tolist() == r.output_ids


def test_plain_generate_stops_at_stop_token(tiny):
    model = LlamaModel(CFG, tiny)
    prompts = [RNG.integers(0, 64, n).tolist() for n in (5, 9)]
    free, _ = decoding.plain_generate(model, prompts, 8, num_slots=2, stop_ids=())
    stop = free[0].output_ids[3]
    first = free[0].output_ids.index(stop)
    stopped, _ = decoding.plain_generate(model, prompts, 8, num_slots=2, stop_ids=[stop])
    assert stopped[0].output_ids == free[0].output_ids[:first + 1] and stopped[0].finished_by_stop
    cut = free[1].output_ids.index(stop) + 1 if stop in free[1].output_ids else 8
    assert stopped[1].output_ids == free[1].output_ids[:cut]


# ----------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct against transformers on the same GGUF

PARITY_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Ein kurzes Gedicht über den Herbst, bitte. 🍂 Und erkläre danach, warum 17 * 23 = 391 ist.",
]
# Logits are float32 on both sides with different summation orders: relative to the largest logit of
# each position the difference stays below ~1e-5; the bound below leaves a margin of ~10x.
PARITY_RTOL, PARITY_ATOL_FRACTION = 1e-4, 1e-4


@pytest.mark.slow
def test_logits_and_hidden_states_match_transformers(target, hf_model):
    import torch

    long_prompt = " ".join(PARITY_PROMPTS * 5)  # 385 tokens: two prefill chunks (256 + 256)
    for text in PARITY_PROMPTS + [long_prompt]:
        ids = target.tokenizer.encode_chat([text])
        cache = target.init_cache(1, 512)
        _, extras, _ = target.prefill(cache, ids, 0, return_extras=True)
        ours = np.asarray(logits_from_hidden(target.weights, extras.final_hidden))
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), output_hidden_states=True)
        ref = out.logits[0].float().numpy()
        scale = np.abs(ref).max(-1, keepdims=True)
        np.testing.assert_allclose(ours, ref, rtol=PARITY_RTOL, atol=PARITY_ATOL_FRACTION * scale.max())
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.99
        # hidden_states[l + 1] is the output of decoder layer l (the last one is normed in transformers).
        for n, layer in enumerate(target.cfg.tap_layers):
            ref_h = out.hidden_states[layer + 1][0].numpy()
            np.testing.assert_allclose(extras.taps[:, n], ref_h, rtol=1e-3, atol=1e-3 * np.abs(ref_h).max())
        ref_final = out.hidden_states[-1][0].numpy()
        np.testing.assert_allclose(extras.final_hidden, ref_final, rtol=1e-3, atol=1e-4 * np.abs(ref_final).max())


@pytest.mark.slow
def test_real_greedy_decode_matches_teacher_forced(target):
    prompts = [target.tokenizer.encode_chat([p]) for p in PARITY_PROMPTS[:2]]
    cache = target.init_cache(2, 128)
    tokens = np.zeros(2, np.int32)
    for s, p in enumerate(prompts):
        logits, _, cache = target.prefill(cache, p, s)
        tokens[s] = int(jnp.argmax(logits))
    generated, step_logits = [[int(t)] for t in tokens], [[], []]
    for _ in range(12):
        logits, _, cache = target.decode(cache, tokens, np.ones(2, bool))
        tokens = np.asarray(jnp.argmax(logits, -1), np.int32)
        for s in range(2):
            generated[s].append(int(tokens[s]))
            step_logits[s].append(np.asarray(logits[s]))
    for s, p in enumerate(prompts):
        full = np.asarray(target.score(p + generated[s]))
        assert full[len(p) - 1:-1].argmax(-1).tolist() == generated[s]
        np.testing.assert_allclose(np.stack(step_logits[s]), full[len(p):-1], rtol=1e-4,
                                   atol=1e-4 * np.abs(full).max())


@pytest.mark.slow
def test_real_packed_verification_equals_each_slot_alone(target):
    tok = target.tokenizer
    prompts = [tok.encode_chat([p]) for p in ("Hi!", PARITY_PROMPTS[1], PARITY_PROMPTS[2])]
    cache = target.init_cache(3, 128)
    for s, p in enumerate(prompts):
        _, _, cache = target.prefill(cache, p, s)
    drafts = [tok.encode(" Sure, here it is"), tok.encode(" Yes"), tok.encode(" Der Herbst")]
    rows = [(t, s, len(prompts[s]) + j) for s in range(3) for j, t in enumerate(drafts[s])]
    rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    tokens, slots, positions = (np.array(c) for c in zip(*rows))
    packed, _, _ = target.verify(copy(cache), tokens, slots, positions, check=True)  # padded to 16
    most = max(map(len, drafts))
    grid, _, _ = target.verify(copy(cache), tokens, slots, positions, max_per_slot=most, check=True)
    np.testing.assert_allclose(grid, packed, rtol=1e-4, atol=1e-4)
    for s in range(3):
        idx = np.flatnonzero(slots == s)
        idx = idx[np.argsort(positions[idx])]  # this slot's drafts in sequence order
        alone, _, _ = target.verify(copy(cache), tokens[idx], slots[idx], positions[idx])  # padded to 8
        np.testing.assert_allclose(packed[idx], alone, rtol=1e-4, atol=1e-4)
        full = np.asarray(target.score(prompts[s] + drafts[s]))
        np.testing.assert_allclose(alone, full[len(prompts[s]):], rtol=1e-4, atol=1e-4 * np.abs(full).max())


@pytest.mark.parametrize("shape", [(1,), (3, 15), (2, 16), (17,), (2, 3, 49)])
def test_first_argmax_equals_argmax_ties_included(shape):
    x = np.random.default_rng(0).integers(-2, 3, shape).astype(np.float32)  # many ties
    x.reshape(-1)[0] = -np.inf
    got = jax.jit(first_argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=-1))
