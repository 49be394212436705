"""Lossless speculative verification for a batch with a different verification length per request.

Axis legend: R requests, G drafted tokens per request, V vocabulary.

One round for request ``r`` (spec section 1): the target ran on ``[x0, x1..x_l]`` with ``l = lengths[r]``
and produced ``target_probs[r, i]``, the distribution of the token after input position ``i``. Drafts are
accepted left to right, ``x_k`` with probability ``min(1, p_t[k-1](x_k) / p_d[k](x_k))``; at the first
rejection the next token is drawn from ``normalize(max(p_t[k-1] - p_d[k], 0))`` (``p_t[k-1]`` if that
has no mass), and if all ``l`` drafts are accepted a bonus token is drawn from ``p_t[l]``. The emitted
tokens then follow the target distribution exactly, for every ``l`` in ``0..G``.

``draft_probs`` must be exactly the float32 distributions the drafts were sampled from (after any
sequential-head bias and temperature); any mismatch silently breaks losslessness. Entries of
``target_probs`` at positions beyond ``lengths[r]`` are never read, so they may hold anything.

A drafter with a reduced vocabulary passes ``draft_vocab`` (int [W], strictly increasing token ids) and
``draft_probs`` over those W tokens; the draft distribution is zero on every other token, which is exactly
what the acceptance rule and the residual then use.

EOS handling (stop at an accepted EOS, no bonus) belongs to the caller, which knows the EOS ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.models.llama import first_argmax
from dspark_jax.sampling import categorical, safe_log

__all__ = ["acceptance_probs", "next_token_probs", "speculative_accept", "greedy_accept", "greedy_accept_tokens",
           "leading_true", "top_p_filter"]


def _check(fn: str, draft_tokens, lengths=None, draft_vocab=None, **probs) -> tuple[int, int]:
    """Static shape and dtype checks (free under jit; they run when a shape is first traced): draft_tokens int
    [R, G], lengths int [R], each named array [R, G + 1, ...] (target) or [R, G, ...] (draft), the draft law
    float32 over the target's vocabulary or ``draft_vocab``. Returns (R, G)."""
    if draft_tokens.ndim != 2:
        raise ValueError(f"{fn}: draft_tokens: expected int [R, G], got shape {tuple(draft_tokens.shape)}")
    r, g = draft_tokens.shape
    if lengths is not None and tuple(lengths.shape) != (r,):
        raise ValueError(f"{fn}: lengths: expected int [R] = [{r}], got shape {tuple(lengths.shape)}")
    if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise ValueError(f"{fn}: draft_tokens: expected integer token ids, got dtype {draft_tokens.dtype}")
    if lengths is not None and not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{fn}: lengths: expected integer counts, got dtype {lengths.dtype}")
    wants = {"target_probs": "[R, G + 1, V]", "target_logits": "[R, G + 1, V]", "target_tokens": "[R, G + 1]",
             "draft_probs": "[R, G, V]"}
    for name, x in probs.items():
        rows = g + 1 if name.startswith("target") else g
        if x.ndim != wants[name].count(",") + 1 or tuple(x.shape[:2]) != (r, rows):
            want = wants[name]
            raise ValueError(f"{fn}: {name}: expected {want} with R = {r}, G = {g} (from draft_tokens), got shape "
                             f"{tuple(x.shape)}")
        if name == "target_tokens" and not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{fn}: target_tokens: expected integer token ids, got dtype {x.dtype}")
    _check_vocab(fn, probs.get("draft_probs"), probs.get("target_probs"), draft_vocab)
    return r, g


def _check_vocab(fn: str, draft_probs, target_probs, draft_vocab) -> None:
    """Static checks of the draft law: float32 (it must be exactly the law the drafts were drawn from; a cast
    copy is not), over V tokens (the target's) or over the W tokens of ``draft_vocab``."""
    if draft_probs is None:
        return
    if draft_probs.dtype != jnp.float32:
        raise ValueError(f"{fn}: draft_probs: expected float32, the exact law the drafts were drawn from, got "
                         f"{draft_probs.dtype} (compute the draft softmax in float32)")
    w = draft_probs.shape[-1]
    if draft_vocab is not None:
        if draft_vocab.ndim != 1 or draft_vocab.shape[0] != w:
            raise ValueError(f"{fn}: draft_vocab: expected int [W] with W = {w} (the last axis of draft_probs), "
                             f"got shape {tuple(draft_vocab.shape)}")
    elif target_probs is not None and target_probs.shape[-1] != w:
        raise ValueError(f"{fn}: draft_probs: expected [R, G, V] over the target's V = {target_probs.shape[-1]} "
                         f"tokens (or pass draft_vocab [W]), got shape {tuple(draft_probs.shape)}")


def _as_distribution(probs: jax.Array) -> jax.Array:
    """float32 rows of a distribution: a lower-precision target law is renormalised after the cast (a bfloat16
    softmax sums to 1 only within its rounding), so the residual and the acceptance ratio use the law meant."""
    if probs.dtype == jnp.float32:
        return probs
    p = probs.astype(jnp.float32)
    total = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)


def _gather_last(x, idx):
    """x [..., V], idx [...] -> x[..., idx]."""
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def leading_true(flags: jax.Array, lengths: jax.Array) -> jax.Array:
    """Number of leading True values of ``flags`` [R, G] within the first ``lengths`` [R] entries."""
    g = flags.shape[-1]
    within = jnp.arange(g)[None, :] < lengths[:, None]
    return jnp.sum(jnp.cumprod(flags & within, axis=-1), axis=-1, dtype=jnp.int32)


def _draft_prob_of(draft_probs, tokens, draft_vocab):
    """p_d(token) for tokens [R, G] from draft_probs [R, G, W] over ``draft_vocab`` (None: all tokens)."""
    if draft_vocab is None:
        return _gather_last(draft_probs, tokens)
    w = draft_vocab.shape[0]
    idx = jnp.clip(jnp.searchsorted(draft_vocab, tokens), 0, w - 1)
    found = draft_vocab[idx] == tokens
    return jnp.where(found, _gather_last(draft_probs, idx), 0.0)


def _full_vocab(probs, draft_vocab, vocab_size):
    """[R, W] over draft_vocab -> [R, V] (zeros elsewhere)."""
    if draft_vocab is None:
        return probs
    return jnp.zeros((probs.shape[0], vocab_size), probs.dtype).at[:, draft_vocab].set(probs)


@jax.jit
def acceptance_probs(draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                     draft_vocab: jax.Array | None = None) -> jax.Array:
    """Probability ``min(1, p_t[k-1](x_k) / p_d[k](x_k))`` that each draft is accepted given its prefix.

    Args:
      draft_tokens: int [R, G].
      draft_probs: float [R, G, V] (or [R, G, W] over ``draft_vocab``), the distributions the drafts
        were sampled from.
      target_probs: float [R, G + 1, V].
      draft_vocab: optional int [W], the draft vocabulary (sorted token ids).

    Returns:
      float32 [R, G].

    >>> acceptance_probs(jnp.array([[0]]), jnp.array([[[0.5, 0.5]]]), jnp.array([[[0.25, 0.75], [1., 0.]]])).tolist()
    [[0.5]]
    """
    _check("acceptance_probs", draft_tokens, draft_vocab=draft_vocab, draft_probs=draft_probs,
           target_probs=target_probs)
    pd = _draft_prob_of(_as_distribution(draft_probs), draft_tokens, draft_vocab)  # [R, G]
    pt = _gather_last(_as_distribution(target_probs[:, :-1]), draft_tokens)  # [R, G]
    safe = jnp.where(pd > 0, pd, 1.0)
    return jnp.where(pd > 0, jnp.minimum(1.0, pt / safe), (pt > 0).astype(jnp.float32))


@jax.jit
def next_token_probs(
    draft_probs: jax.Array,
    target_probs: jax.Array,
    num_accepted: jax.Array,
    lengths: jax.Array,
    draft_vocab: jax.Array | None = None,
) -> jax.Array:
    """Distribution of the token emitted after ``num_accepted`` accepted drafts.

    The residual ``normalize(max(p_t[n] - p_d[n], 0))`` after a rejection at draft ``n + 1`` (``n <
    lengths``), falling back to ``p_t[n]`` when the residual has no mass; the bonus ``p_t[l]`` when all
    ``l = lengths`` drafts were accepted.

    Args:
      draft_probs: float [R, G, V] (or [R, G, W] over ``draft_vocab``).
      target_probs: float [R, G + 1, V].
      num_accepted: int [R], each in 0..lengths.
      lengths: int [R], each in 0..G (clipped to it).
      draft_vocab: optional int [W], the draft vocabulary (sorted token ids).

    Returns:
      float32 [R, V].
    """
    if draft_probs.ndim != 3 or target_probs.ndim != 3 or target_probs.shape[:2] != (draft_probs.shape[0],
                                                                                      draft_probs.shape[1] + 1):
        raise ValueError(f"next_token_probs: expected draft_probs [R, G, V] and target_probs [R, G + 1, V], got "
                         f"shapes {tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
    _check_vocab("next_token_probs", draft_probs, target_probs, draft_vocab)
    g = draft_probs.shape[1]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, g)
    n = jnp.clip(num_accepted.astype(jnp.int32), 0, lengths)
    pt = jnp.take_along_axis(_as_distribution(target_probs), n[:, None, None], axis=1)[:, 0]  # [R, V]
    pd = jnp.take_along_axis(_as_distribution(draft_probs), jnp.minimum(n, g - 1)[:, None, None], axis=1)[:, 0]
    pd = _full_vocab(pd, draft_vocab, pt.shape[-1])  # [R, V]
    residual = jnp.maximum(pt - pd, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), pt)
    rejected = (n < lengths)[:, None]
    return jnp.where(rejected, residual, pt)


def _row_keys(key, num_rows):
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.random.split(key, num_rows)
    if key.shape != (num_rows,):
        raise ValueError(f"key: expected one key or a batch of {num_rows} keys, got key shape {key.shape}")
    return key


@jax.jit
def speculative_accept(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    lengths: jax.Array,
    draft_vocab: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sampled speculative acceptance with a verification length per request (exactly lossless).

    Args:
      key: one PRNG key (split per row) or a batch of R keys (one per row, so a row's outcome does not
        depend on the rest of the batch). New-style or raw uint32 keys.
      draft_tokens: int [R, G].
      draft_probs: float [R, G, V], the exact distributions the drafts were drawn from.
      target_probs: float [R, G + 1, V]; row ``i`` is the target's next-token distribution after input
        position ``i`` of ``[x0, x1..x_l]``.
      lengths: int [R], drafts verified per row, each in 0..G (clipped to it).
      draft_vocab: optional int [W]; then ``draft_probs`` is [R, G, W] over these token ids.

    ``draft_probs`` must be float32 (a cast copy is not the law the drafts were drawn from); target
    probabilities in a lower precision are renormalised after the cast to float32.

    Returns:
      ``(num_accepted, next_token)``: int32 [R] accepted drafts (0..lengths) and int32 [R] the token
      emitted after them (replacement or bonus).

    A draft the target would have produced with certainty is always accepted:

    >>> p = jnp.array([[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]])  # [R=1, G+1=3, V=2]: target is sure of 1, 0, 1
    >>> q = jnp.array([[[0.5, 0.5], [0.5, 0.5]]])                # [R, G, V]: the drafter's distributions
    >>> n, nxt = speculative_accept(jax.random.key(0), jnp.array([[1, 0]]), q, p, jnp.array([2]))
    >>> n.tolist(), nxt.tolist()
    ([2], [1])
    """
    num_rows, g = _check("speculative_accept", draft_tokens, lengths, draft_vocab, draft_probs=draft_probs,
                         target_probs=target_probs)
    keys = _row_keys(key, num_rows)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, g)

    def row_randomness(k):
        k_accept, k_sample = jax.random.split(k)
        return jax.random.uniform(k_accept, (g,)), k_sample

    u, sample_keys = jax.vmap(row_randomness)(keys)  # [R, G], [R]
    accepted = u < acceptance_probs(draft_tokens, draft_probs, target_probs, draft_vocab)
    n = leading_true(accepted, lengths)
    probs = next_token_probs(draft_probs, target_probs, n, lengths, draft_vocab)  # [R, V]
    nxt = categorical(sample_keys, safe_log(probs))
    return n, nxt


@jax.jit
def greedy_accept(
    draft_tokens: jax.Array, target_logits: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Temperature-0 acceptance: accept while each draft equals the target's argmax.

    Args:
      draft_tokens: int [R, G].
      target_logits: float [R, G + 1, V] (or probabilities: only the argmax is used; ties take the
        lowest token id, as ``jnp.argmax`` in plain greedy decoding).
      lengths: int [R], each in 0..G.

    Returns:
      ``(num_accepted, next_token)``, int32 [R] each.

    >>> greedy_accept(jnp.array([[1, 0]]), jnp.array([[[0., 1.], [0., 1.], [1., 0.]]]), jnp.array([2]))
    (Array([1], dtype=int32), Array([1], dtype=int32))
    """
    _check("greedy_accept", draft_tokens, lengths, target_logits=target_logits)
    return greedy_accept_tokens(draft_tokens, first_argmax(target_logits), lengths)  # argmax [R, G + 1]


@jax.jit
def greedy_accept_tokens(
    draft_tokens: jax.Array, target_tokens: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`greedy_accept` from the target's greedy tokens: accept while each draft equals the target's token.

    Taking the argmax where the logits are flat ([T, V], one row per verified token) and gathering the token
    ids into rows costs T rows of work instead of R x (G + 1) padded ones.

    Args:
      draft_tokens: int [R, G].
      target_tokens: int [R, G + 1], the target's argmax (lowest id on ties) after the anchor and each draft.
      lengths: int [R], each in 0..G.

    Returns:
      ``(num_accepted, next_token)``, int32 [R] each.

    >>> greedy_accept_tokens(jnp.array([[1, 0]]), jnp.array([[1, 1, 0]]), jnp.array([2]))
    (Array([1], dtype=int32), Array([1], dtype=int32))
    """
    _check("greedy_accept_tokens", draft_tokens, lengths, target_tokens=target_tokens)
    best = target_tokens.astype(jnp.int32)
    n = leading_true(draft_tokens.astype(jnp.int32) == best[:, :-1], lengths.astype(jnp.int32))
    nxt = jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
    return n, nxt


@jax.jit
def top_p_filter(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Nucleus (top-p) law: keep the most likely tokens, in order, while the mass before them is below
    ``top_p`` (the smallest such set whose mass reaches ``top_p``; ties by lower token id first), renormalised.

    Passing the result as ``target_probs`` to `speculative_accept` makes the emitted tokens follow this law
    exactly, whatever the drafts were drawn from.

    Args:
      probs: float [..., V], each row a distribution.
      top_p: float [...] in (0, 1]; rows with ``top_p >= 1`` are returned unchanged.

    Returns:
      float32 [..., V].

    >>> top_p_filter(jnp.array([0.5, 0.3, 0.2]), jnp.array(0.7)).tolist()
    [0.625, 0.375, 0.0]
    """
    probs = probs.astype(jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    order = jnp.argsort(probs, axis=-1, stable=True, descending=True)  # [..., V]
    ranked = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(ranked, axis=-1) - ranked  # mass of the tokens ranked above each
    keep_ranked = before < top_p[..., None]
    keep = jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)  # back to token order
    kept = jnp.where(keep, probs, 0.0)
    out = kept / jnp.sum(kept, axis=-1, keepdims=True)
    return jnp.where(top_p[..., None] >= 1, probs, out)
