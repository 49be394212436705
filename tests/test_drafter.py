"""The drafter: masks, teacher-forced against sampled paths, the context cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import LlamaConfig, init_random_weights

TARGET = LlamaConfig.tiny()  # vocab 64, width 32


def make(head="markov", confidence=True, vocab_ids=None, block=4, seed=0):
    cfg = dr.DrafterConfig.for_target(
        TARGET, head=head, confidence=confidence, rank=8, block=block, n_layers=2, ffn_dim=48,
        draft_vocab_size=0 if vocab_ids is None else len(vocab_ids),
    )
    d = dr.Drafter(cfg, rngs=nnx.Rngs(seed), vocab_ids=vocab_ids)
    # Non-zero sequential head so that the previous token matters.
    if head != "none":
        d.w2.kernel[...] = 0.5 * jax.random.normal(jax.random.key(seed + 1), d.w2.kernel[...].shape)
    return d


@pytest.fixture(scope="module")
def target():
    return init_random_weights(TARGET, jax.random.key(0))


def context(n, s, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, s, 5, TARGET.dim))


def test_block_sees_only_context_before_its_anchor(target):
    d = make()
    taps = context(1, 10)
    pos = jnp.arange(10)[None]
    anchors, anchor_pos = jnp.array([[5, 9]]), jnp.array([[4, 7]])  # two blocks of one sequence
    mask = jnp.arange(10)[None, None, :] < anchor_pos[..., None]

    @nnx.jit
    def run(d, t):
        k, v = d.context_kv(t, pos)
        return d.hidden(k, v, mask, anchors, anchor_pos, target.embed)

    base = run(d, taps)
    # Changing the anchor's own features (position 4) must not change block 0; it changes block 1.
    moved = run(d, taps.at[0, 4].add(1.0))
    np.testing.assert_array_equal(moved[0, 0], base[0, 0])
    assert np.abs(np.asarray(moved[0, 1] - base[0, 1])).max() > 1e-4
    # Features at positions >= 7 are invisible to both blocks.
    np.testing.assert_array_equal(run(d, taps.at[0, 7:].add(3.0)), base)


def test_empty_context_gives_no_nan(target):
    d = make()
    k, v = d.context_kv(context(2, 6), jnp.tile(jnp.arange(6), (2, 1)))
    mask = jnp.zeros((2, 1, 6), bool)
    h = d.hidden(k, v, mask, jnp.array([[3], [4]]), jnp.array([[0], [0]]), target.embed)
    assert np.isfinite(np.asarray(h)).all()


def test_attention_mask_golden():
    """One head, E=2, hand-computed: the block attends to visible context and to its own slots only."""
    cfg = dr.DrafterConfig(vocab_size=8, dim=2, n_taps=1, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                           ffn_dim=2, block=2, head="none", confidence=False)
    layer = dr.DraftLayer(cfg, rngs=nnx.Rngs(0))
    eye = jnp.eye(2)
    for lin in (layer.wq, layer.wk, layer.wv, layer.wo):
        lin.kernel[...] = eye
    for lin in (layer.w_gate, layer.w_up, layer.w_down):
        lin.kernel[...] = jnp.zeros((2, 2))
    x = jnp.array([[[[1.0, 0.0], [0.0, 1.0]]]])  # [N=1, B=1, G=2, D=2]
    zeros = jnp.zeros((1, 1, 2), jnp.int32)  # position 0: RoPE is the identity
    ctx_k = jnp.array([[[[5.0, 0.0]], [[0.0, 5.0]], [[9.0, 9.0]]]])  # [N, S=3, K, E]
    ctx_v = jnp.array([[[[10.0, 0.0]], [[0.0, 10.0]], [[100.0, 100.0]]]])
    mask = jnp.array([[[True, True, False]]])  # third context position hidden
    out = layer(x, zeros, ctx_k, ctx_v, mask)
    # reference: keys = [ctx0, ctx1, block0, block1] after the RMSNorm of x (norm weight 1)
    hn = np.asarray(x[0, 0]) / np.sqrt(np.mean(np.asarray(x[0, 0]) ** 2, -1, keepdims=True) + 1e-5)
    keys = np.concatenate([np.asarray(ctx_k[0, :2, 0]), hn])
    vals = np.concatenate([np.asarray(ctx_v[0, :2, 0]), hn])
    s = hn @ keys.T / np.sqrt(2)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out[0, 0], np.asarray(x[0, 0]) + p @ vals, rtol=1e-5, atol=1e-5)


def test_grouped_heads_attend_as_one_softmax_over_context_and_block():
    """Several query heads per key head (K = 2, Q = 2), against NumPy: one softmax per query over the visible
    context and the whole block, with a block that sees no context; its gradient stays finite."""
    cfg = dr.DrafterConfig(vocab_size=8, dim=8, n_taps=1, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=4,
                           ffn_dim=8, block=3, head="none", confidence=False)
    layer = dr.DraftLayer(cfg, rngs=nnx.Rngs(1))
    for lin in (layer.w_gate, layer.w_up, layer.w_down):
        lin.kernel[...] = jnp.zeros(lin.kernel[...].shape)
    rng = np.random.default_rng(0)
    N, B, G, S, K, Q, E = 2, 2, 3, 5, 2, 2, 4
    x = jnp.asarray(rng.normal(size=(N, B, G, 8)), jnp.float32)
    zeros = jnp.zeros((N, B, G), jnp.int32)  # position 0: RoPE is the identity
    ctx_k, ctx_v = (jnp.asarray(rng.normal(size=(N, S, K, E)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((N, B, S)) < 0.6).at[1, 0].set(False)
    out = np.asarray(layer(x, zeros, ctx_k, ctx_v, mask))
    xn = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-5)
    w = {n: np.asarray(getattr(layer, n).kernel[...]) for n in ("wq", "wk", "wv", "wo")}
    q, kb, vb = (xn @ w["wq"]).reshape(N, B, G, K * Q, E), (xn @ w["wk"]).reshape(N, B, G, K, E), (
        xn @ w["wv"]).reshape(N, B, G, K, E)
    want = np.zeros((N, B, G, K * Q, E))
    for n in range(N):
        for b in range(B):
            seen = np.asarray(mask[n, b])
            for h in range(K * Q):
                k = h // Q
                keys = np.concatenate([np.asarray(ctx_k[n, seen, k]), kb[n, b, :, k]])
                vals = np.concatenate([np.asarray(ctx_v[n, seen, k]), vb[n, b, :, k]])
                sc = q[n, b, :, h] @ keys.T / np.sqrt(E)
                p = np.exp(sc - sc.max(-1, keepdims=True))
                want[n, b, :, h] = (p / p.sum(-1, keepdims=True)) @ vals
    want = np.asarray(x) + want.reshape(N, B, G, K * Q * E) @ w["wo"]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    grads = jax.grad(lambda kk, vv: jnp.sum(jnp.sin(layer(x, zeros, kk, vv, mask))), argnums=(0, 1))(ctx_k, ctx_v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_array_equal(np.asarray(grads[0])[1, ~np.asarray(mask[1]).any(0)], 0.0)  # unseen: no gradient


def test_float16_attention_over_a_long_flat_context_stays_finite():
    """Sums of thousands of exponentials times values pass float16's range before the division: the products
    accumulate in float32, so a float16 layer over 8192 equal context positions matches float32's."""
    cfg = dr.DrafterConfig(vocab_size=8, dim=8, n_taps=1, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
                           ffn_dim=8, block=2, head="none", confidence=False)
    layer = dr.DraftLayer(cfg, rngs=nnx.Rngs(0))
    S = 8192
    x = jnp.ones((1, 1, 2, 8), jnp.float32)
    pos = jnp.zeros((1, 1, 2), jnp.int32)
    ctx_k, ctx_v = jnp.zeros((1, S, 1, 4)), jnp.full((1, S, 1, 4), 10.0)
    mask = jnp.ones((1, 1, S), bool)
    want = np.asarray(layer(x, pos, ctx_k, ctx_v, mask))
    graphdef, state = nnx.split(layer)
    layer16 = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float16), state))
    got = np.asarray(layer16(x.astype(jnp.float16), pos, ctx_k.astype(jnp.float16), ctx_v.astype(jnp.float16), mask))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_teacher_forced_equals_sampled_path(target, head):
    d = make(head=head, confidence=head != "none")
    R, G = 3, d.cfg.block
    h = jax.random.normal(jax.random.key(3), (R, G, TARGET.dim))
    head_w = dr.draft_head_weights(d, target.embed)
    anchors = jnp.array([1, 2, 3])
    keys = jax.random.split(jax.random.key(4), R)
    sample = nnx.jit(dr.sample_block)
    forced = nnx.jit(lambda d, h, prev, w: d.teacher_forced(h, prev, w))
    for temp in (1.0, 0.7):
        tokens, probs, conf = sample(d, h, anchors, keys, jnp.float32(temp), head_w)
        prev = jnp.concatenate([anchors[:, None], tokens[:, :-1]], axis=1)
        logits, conf_tf = forced(d, h, prev, head_w)
        np.testing.assert_allclose(probs, jax.nn.softmax(logits / temp, -1), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(conf, conf_tf, rtol=1e-5, atol=1e-6)
        # the drawn token has positive probability under the returned distribution
        assert np.all(np.take_along_axis(np.asarray(probs), np.asarray(tokens)[..., None], -1) > 0)
    tokens, probs, _ = sample(d, h, anchors, keys, jnp.float32(0.0), head_w)
    prev = jnp.concatenate([anchors[:, None], tokens[:, :-1]], axis=1)
    logits, _ = forced(d, h, prev, head_w)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))
    np.testing.assert_array_equal(probs, jax.nn.one_hot(tokens, TARGET.vocab_size))


def test_markov_previous_token_changes_the_distribution(target):
    d = make()
    h = jnp.zeros((1, d.cfg.block, TARGET.dim))
    head_w = dr.draft_head_weights(d, target.embed)
    a, _ = d.teacher_forced(h, jnp.array([[1, 1, 1, 1]]), head_w)
    b, _ = d.teacher_forced(h, jnp.array([[1, 2, 1, 1]]), head_w)
    assert np.abs(np.asarray(a[0, 1] - b[0, 1])).max() > 1e-3
    np.testing.assert_array_equal(a[0, 0], b[0, 0])


def test_sampling_statistics_follow_returned_probs(target):
    d = make(block=2)
    R = 4000
    h = jnp.broadcast_to(jax.random.normal(jax.random.key(9), (1, 2, TARGET.dim)), (R, 2, TARGET.dim))
    head_w = dr.draft_head_weights(d, target.embed)
    tokens, probs, _ = nnx.jit(dr.sample_block)(d, h, jnp.full((R,), 5), jax.random.split(jax.random.key(1), R),
                                                jnp.float32(1.0), head_w)
    freq = np.bincount(np.asarray(tokens[:, 0]), minlength=TARGET.vocab_size) / R
    np.testing.assert_allclose(freq, np.asarray(probs[0, 0]), atol=0.03)


def test_reduced_vocabulary_proposes_only_its_tokens(target):
    vocab = np.array([0, 3, 5, 8, 13, 21, 34, 55])
    d = make(vocab_ids=vocab)
    h = jax.random.normal(jax.random.key(2), (6, d.cfg.block, TARGET.dim))
    head_w = dr.draft_head_weights(d, target.embed)
    tokens, probs, _ = nnx.jit(dr.sample_block)(d, h, jnp.arange(6) + 40, jax.random.split(jax.random.key(0), 6),
                                                jnp.float32(1.0), head_w)
    assert probs.shape == (6, d.cfg.block, 8)
    assert set(np.asarray(tokens).ravel()) <= set(vocab.tolist())
    full = dr.expand_draft_probs(probs, jnp.asarray(vocab), TARGET.vocab_size)
    np.testing.assert_allclose(full.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(full[..., vocab], probs)


def test_context_cache_matches_full_recompute(target):
    d = make()
    C, n_ctx = 16, 9
    taps = context(1, n_ctx, seed=5)[0]  # [S, M, D]
    cache = dr.init_drafter_cache(d.cfg, num_slots=3, capacity=C)
    write = nnx.jit(dr.write_context)
    # write the context of slot 1 in two appends, plus a rejected tail that must stay invisible
    cache = write(d, cache, taps[:5], jnp.full(5, 1), jnp.arange(5), jnp.ones(5, bool))
    cache = write(d, cache, taps[5:], jnp.full(4, 1), jnp.arange(5, 9), jnp.ones(4, bool))
    junk = context(1, 3, seed=6)[0]
    cache = write(d, cache, junk, jnp.full(3, 1), jnp.arange(9, 12), jnp.array([True, True, False]))
    head_w = dr.draft_head_weights(d, target.embed)
    keys = jax.random.split(jax.random.key(0), 1)
    got = nnx.jit(dr.draft)(d, cache, jnp.array([1]), jnp.array([n_ctx]), jnp.array([7]), keys, jnp.float32(0.0),
                            target.embed, head_w)

    @nnx.jit
    def recompute(d):
        k, v = d.context_kv(taps[None], jnp.arange(n_ctx)[None])
        h = d.hidden(k, v, jnp.ones((1, 1, n_ctx), bool), jnp.array([[7]]), jnp.array([[n_ctx]]), target.embed)
        return dr.sample_block(d, h[:, 0], jnp.array([7]), keys, jnp.float32(0.0), head_w)

    want = recompute(d)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_tap_norm_puts_every_tap_on_one_scale(tmp_path):
    """With tap_norm each tapped layer is RMS-normalised on its own: scaling one tap changes nothing, while the
    plain drafter sees it; the per-tap scales are parameters that save and load with the drafter."""
    from dspark_jax.models.drafter_files import load_drafter, save_drafter

    cfg = dr.DrafterConfig.for_target(TARGET, rank=8, block=4, n_layers=1, ffn_dim=48, tap_norm=True)
    d = dr.Drafter(cfg, rngs=nnx.Rngs(0))
    d.tap_scale[...] = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), d.tap_scale[...].shape)
    plain = dr.Drafter(dr.DrafterConfig.for_target(TARGET, rank=8, block=4, n_layers=1, ffn_dim=48),
                       rngs=nnx.Rngs(0))
    taps = context(2, 6)
    scaled = taps.at[..., 3, :].multiply(40.0)  # one layer 40 x louder, as deep layers are
    np.testing.assert_allclose(d.context_features(scaled), d.context_features(taps), rtol=1e-4, atol=1e-5)
    assert not np.allclose(plain.context_features(scaled), plain.context_features(taps), atol=1e-3)
    save_drafter(d, tmp_path / "d")
    back, _ = load_drafter(tmp_path / "d")
    assert back.cfg.tap_norm
    np.testing.assert_allclose(back.context_features(taps), d.context_features(taps), rtol=1e-2, atol=1e-2)


def test_tap_scale_is_applied_alike_to_few_and_many_tokens():
    """The per-tap scale multiplies the taps of a call with fewer tokens than the width (a decoding round: no
    rewrite of the whole projection kernel) and the kernel otherwise (training); both are the same function:
    each token's features do not depend on how many tokens share its call."""
    cfg = dr.DrafterConfig.for_target(TARGET, rank=8, block=4, n_layers=1, ffn_dim=48, tap_norm=True)
    d = dr.Drafter(cfg, rngs=nnx.Rngs(0))
    d.tap_scale[...] = 1.0 + 0.5 * jax.random.normal(jax.random.key(3), d.tap_scale[...].shape)
    many = TARGET.dim + 8  # rows >= width: the kernel path
    taps = jax.random.normal(jax.random.key(4), (many, cfg.n_taps, TARGET.dim))
    every = d.context_features(taps)
    few = jnp.concatenate([d.context_features(taps[i:i + 5]) for i in range(0, 15, 5)])  # 5 rows < width each
    np.testing.assert_allclose(few, every[:15], rtol=1e-5, atol=1e-5)
    unscaled = dr.Drafter(cfg, rngs=nnx.Rngs(0))  # tap_scale all ones: a different function on both paths
    assert not np.allclose(unscaled.context_features(taps[:5]), few[:5], atol=1e-3)
    assert not np.allclose(unscaled.context_features(taps)[:5], every[:5], atol=1e-3)
