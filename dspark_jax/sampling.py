"""Exact categorical draws over large vocabularies, cheap on every backend.

``jax.random.categorical`` adds one Gumbel variate to every logit: 49 152 logarithms of logarithms per row for
SmolLM2's vocabulary, ~57 ms for 64 rows on a 2-core CPU, more than the rest of a sampling step. The draw here
is the same Gumbel-max trick applied twice: first over blocks of ``block`` logits (each block weighted by its
log-sum-exp), then within the block drawn. Block ``b`` is chosen with probability ``Z_b / Z`` and token ``j``
in it with ``exp(x_j) / Z_b``, so every token has exactly ``softmax(x)_j``: the law is the one
``jax.random.categorical`` samples, with ``V / block + block`` Gumbel variates a row instead of ``V`` (a few
hundred), and the log-domain arithmetic keeps tokens with tiny probability as exact as the one-level draw.
The random stream differs from ``jax.random.categorical``'s, so the same key draws other tokens.

`logprobs_at` reports what a request asks for with ``logprobs``: the raw log-softmax of the target's logits
(temperature 1, no top-p), the law the model itself gives, as vLLM's default ``raw_logprobs``.

Axis legend: R rows, N categories (vocabulary or draft vocabulary), B block, P positions asked about, K top.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax.models.llama import first_argmax

BLOCK = 128
# Temperatures below this decode greedily (as in vLLM): logits divided by a smaller one overflow float32 (a
# temperature of 1e-40 makes every logit infinite), and the law is already the argmax's within float32.
GREEDY_TEMPERATURE = 1e-5
# The most alternatives a request may ask for per token (OpenAI's ``top_logprobs`` bound): the programs always
# compute this many (a static size), the host keeps what each request asked for.
MAX_LOGPROBS = 20


def effective_temperature(t: float) -> float:
    """The temperature a request decodes at: ``t``, or 0 (greedy) below `GREEDY_TEMPERATURE`."""
    return 0.0 if t < GREEDY_TEMPERATURE else float(t)


def safe_log(x: jax.Array) -> jax.Array:
    """``log(x)`` where ``x > 0`` and ``-inf`` elsewhere (``log`` never sees a 0, so no NaN gradient):
    probabilities [..., N] -> logits for :func:`categorical`.

    >>> safe_log(jnp.array([1.0, 0.0])).tolist()
    [0.0, -inf]
    """
    return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("block",))
def categorical(keys: jax.Array, logits: jax.Array, *, block: int = BLOCK) -> jax.Array:
    """One draw per row from ``softmax(logits)``, with a key per row.

    Args:
      keys: [R] PRNG keys (new-style key array, or raw uint32 [R, 2]).
      logits: float [R, N]; ``-inf`` marks categories of probability 0 (a row needs one finite entry).
      block: categories per block of the first draw (static; N is padded with ``-inf`` to a multiple).

    Returns:
      int32 [R] indices into N.

    >>> keys = jax.random.split(jax.random.key(0), 3)
    >>> categorical(keys, jnp.array([[0., -jnp.inf, -jnp.inf], [-jnp.inf, 3., -jnp.inf],
    ...                              [-jnp.inf, -jnp.inf, 1.]])).tolist()
    [0, 1, 2]
    """
    rows, n = logits.shape
    logits = logits.astype(jnp.float32)
    nb = -(-n // block)
    if nb * block != n:
        logits = jnp.pad(logits, ((0, 0), (0, nb * block - n)), constant_values=-jnp.inf)
    blocks = logits.reshape(rows, nb, block)  # [R, NB, B]
    top = jnp.max(blocks, axis=-1)  # [R, NB]
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    mass = jnp.sum(jnp.exp(blocks - safe_top[..., None]), axis=-1)  # [R, NB]; 0 for all -inf blocks
    block_logit = safe_top + safe_log(mass)  # -inf for all -inf blocks

    def gumbels(key):
        k_block, k_inner = jax.random.split(key)
        return jax.random.gumbel(k_block, (nb,)), jax.random.gumbel(k_inner, (block,))

    g_block, g_inner = jax.vmap(gumbels)(keys)  # [R, NB], [R, B]
    b = first_argmax(block_logit + g_block)  # [R]
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [R, B]
    j = first_argmax(inner + g_inner)
    return (b * block + j).astype(jnp.int32)


def logprobs_at(logits: jax.Array, at: jax.Array, tokens: jax.Array, *, k: int = MAX_LOGPROBS):
    """Raw log-probabilities (``log_softmax(logits)`` in float32: temperature 1, no top-p) of chosen tokens, with
    the ``k`` most likely tokens, at some rows of a logits array (the rows are gathered after the reductions: no
    copy of [P, N] logits).

    Args:
      logits: float [R, N].
      at: int [...P] the rows asked about (in [0, R)).
      tokens: int [...P] the token whose log-probability to report at each.
      k: static; at most N (fewer categories: all of them).

    Returns:
      (logprob float32 [...P], top ids int32 [...P, k'], top log-probabilities float32 [...P, k'] in descending
      order, ties by the lower id), k' = min(k, N).

    >>> lp, ids, top = logprobs_at(jnp.log(jnp.array([[0.5, 0.25, 0.25]])), jnp.array([0, 0]),
    ...                            jnp.array([1, 0]), k=2)
    >>> jnp.exp(lp).round(3).tolist(), ids.tolist(), jnp.exp(top).round(3).tolist()
    ([0.25, 0.5], [[0, 1], [0, 1]], [[0.5, 0.25], [0.5, 0.25]])
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [R]
    top_v, top_i = jax.lax.top_k(logits, min(k, logits.shape[-1]))  # [R, k']
    chosen = logits[at, tokens] - lse[at]  # [...P]
    return chosen, top_i[at].astype(jnp.int32), top_v[at] - lse[at][..., None]
