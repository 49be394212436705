"""Llama-family target model as plain pytrees and functions, with a slotted KV cache.

One forward serves three entry points: chunked prefill of a prompt into a slot, plain decode of one token
per active slot, and packed verification of a flat, ragged batch of tokens drawn from many slots.
Weights and KV cache are held per layer (tuples of L arrays) and the layer loop is unrolled: XLA's CPU backend
copies a slice of a stacked [L, ...] array before a matrix product reads it, which made the attention of a
decode step over a stacked cache 1.2-3.3x slower (``profiling.bench_attention``; docs/design.md).

Axis legend (also the einsum letters):
    T new tokens in a call (static, padded to a bucket)   S request slots of the cache
    C cache capacity per slot                             L decoder layers
    D model width       F FFN width       V vocabulary    N tapped layers
    H query heads       K key/value heads Q query heads per K/V head (H = K * Q)
    E head dimension
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dspark_jax import kernels

# Padded sizes for the number of new tokens in one packed call: the cost of a step grows with the real
# number of tokens, and each size compiles once.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Chunk sizes for prefill: a prompt is cut into chunks of these sizes, so prompt lengths do not each compile.
PREFILL_CHUNKS = (16, 64, 256)
# Granularity of the attention window over the cache (see `context_bucket`), and of the reads of `over_context`.
CONTEXT_STEP = 128
# Positions one iteration of `over_context`'s loop reads: contexts up to a chunk run no loop iteration.
ATTENTION_CHUNK = 512


def context_bucket(n: int, capacity: int, step: int = CONTEXT_STEP) -> int:
    """The static context window for attention when every position lies below ``n``: ``n`` rounded up to
    a multiple of ``step``, at most the capacity (a few shapes, each compiled once).

    >>> context_bucket(130, 1024)
    256
    """
    return min(capacity, max(step, -(-int(n) // step) * step))


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket that holds `n` tokens.

    >>> bucket_for(9)
    16
    """
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"n={n} tokens exceed the largest bucket {buckets[-1]} (buckets: {tuple(buckets)})")


def grid_bucket(n: int, cap: int) -> int:
    """The static grid width (`forward_packed`'s ``max_per_slot``) for rows of at most ``n`` tokens: the
    smallest power of two >= n, at least 2, at most ``cap`` (the block + 1). The attention of a packed
    verification grows with the width, so a round whose rows verify few drafts reads less.

    >>> [grid_bucket(n, 8) for n in (1, 2, 3, 5, 8)]
    [2, 2, 4, 8, 8]
    """
    if not 1 <= n <= cap:
        raise ValueError(f"n={n} tokens per row must lie in [1, cap={cap}]")
    return min(cap, max(2, 1 << (int(n) - 1).bit_length()))


def default_tap_layers(n_layers: int, m: int = 5) -> tuple[int, ...]:
    """The m target layers whose raw outputs feed the drafter (spec section 2.1).

    round(1 + i * (L - 4) / (m - 1)) for i = 0..m-1 (Python's round, as the public code), clipped so the
    final layer is never tapped when the model has more than one layer.

    >>> default_tap_layers(30)
    (1, 8, 14, 20, 27)
    """
    last = max(n_layers - 2, 0)
    return tuple(min(max(round(1 + i * (n_layers - 4) / (m - 1)), 0), last) for i in range(m))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for long contexts, as Hugging Face configs state it (``rope_scaling``).

    kind ``"llama3"`` (Llama 3.1 onwards): wavelengths longer than original_max_positions / low_freq_factor are
    stretched by `factor`, those shorter than original_max_positions / high_freq_factor kept, and the band
    between interpolated smoothly. kind ``"linear"``: every frequency divided by `factor` (position
    interpolation).
    """

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"RopeScaling kind must be 'llama3' or 'linear'; got {self.kind!r}")
        if self.factor <= 0:
            raise ValueError(f"RopeScaling factor must be > 0; got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"RopeScaling high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                             f"({self.low_freq_factor})")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static model hyperparameters (hashable: passed to jitted functions as a static argument)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    tap_layers: tuple[int, ...] | None = None  # None: default_tap_layers(n_layers)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's E features of q and k, before RoPE
    attn_bias: bool = False  # Qwen2: biases on the q, k and v projections

    def __post_init__(self):
        if self.tap_layers is None:
            object.__setattr__(self, "tap_layers", default_tap_layers(self.n_layers))
        else:
            object.__setattr__(self, "tap_layers", tuple(int(i) for i in self.tap_layers))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        bad = [i for i in self.tap_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"tap_layers {self.tap_layers} must lie in [0, {self.n_layers}); got {bad}")

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small random-weight config for fast tests (vocab 64, 2 layers, width 32)."""
        base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                    rope_base=10000.0, norm_eps=1e-5, tie_embeddings=True)
        base.update(overrides)
        return cls(**base)


# SmolLM2-135M-Instruct, as its GGUF metadata states it (load_gguf reads the config from the file).
SMOLLM2_135M = LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                           ffn_dim=1536, rope_base=100000.0, norm_eps=1e-5, tie_embeddings=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights; projections are applied as x @ W."""

    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [D, H*E]  (head features in Hugging Face's rotate-half order, not llama.cpp's)
    wk: jax.Array  # [D, K*E]
    wv: jax.Array  # [D, K*E]
    wo: jax.Array  # [H*E, D]
    mlp_norm: jax.Array  # [D]
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]
    q_norm: jax.Array | None = None  # [E] with cfg.qk_norm, else None
    k_norm: jax.Array | None = None  # [E] with cfg.qk_norm
    bq: jax.Array | None = None  # [H*E] with cfg.attn_bias
    bk: jax.Array | None = None  # [K*E] with cfg.attn_bias
    bv: jax.Array | None = None  # [K*E] with cfg.attn_bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LlamaWeights:
    embed: jax.Array  # [V, D]
    layers: tuple[LayerWeights, ...]  # L layers
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]; None when tied to embed

    def replace(self, **kw) -> "LlamaWeights":
        return dataclasses.replace(self, **kw)

    def stacked(self, field: str) -> jax.Array | None:
        """One weight of every layer stacked on a leading axis, [L, ...] (None for an absent optional weight).

        >>> init_random_weights(LlamaConfig.tiny(), jax.random.key(0)).stacked("wq").shape
        (2, 32, 32)
        """
        parts = [getattr(lw, field) for lw in self.layers]
        return None if parts[0] is None else jnp.stack(parts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys (after RoPE) and values of every slot; `lengths[s]` tokens of slot s are committed.

    Entries at positions >= lengths[s] may hold written but uncommitted K/V (a verification's rejected
    tail); they are invisible to a token at an earlier position and get overwritten later.

    Layout: keys are stored transposed, [.., E, C], so that both attention products are plain matrix
    products over the cache (on the CPU, 5-10x faster than the [.., C, K, E] layout, which makes XLA
    transpose the whole slot cache of every layer at every step). Each layer's arrays are separate (see the
    module docstring). `read` gives entries as [L, n, K, E].
    """

    k: tuple[jax.Array, ...]  # L arrays [S, K, E, C]
    v: tuple[jax.Array, ...]  # L arrays [S, K, C, E]
    lengths: jax.Array  # int32 [S]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[-1]

    @property
    def dtype(self):
        return self.k[0].dtype

    def read(self, slot, positions) -> tuple[jax.Array, jax.Array]:
        """K and V of `slot` at `positions` (int [n]), each [L, n, K, E]."""
        positions = jnp.asarray(positions)
        k = jnp.stack([jnp.moveaxis(k[slot][..., positions], -1, 0) for k in self.k])  # [K, E, n] -> [n, K, E]
        v = jnp.stack([jnp.moveaxis(v[slot][:, positions], 1, 0) for v in self.v])  # [K, n, E] -> [n, K, E]
        return k, v

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Keys (after RoPE) and values in a page pool per layer, found through a block table per slot.

    Layout: the kernels' (`dspark_jax.kernels`): per layer ``[P, ps, 2K, E]``, keys and values interleaved on
    the combined head axis; slot ``s``'s position ``p`` lives in page ``block_tables[s, p // ps]`` at offset
    ``p % ps``. The host allocates the pages (`dspark_jax.cache.pages.PagePool`) before a call writes them; as
    with `KVCache`, entries past ``lengths[s]`` are uncommitted and invisible. `read` gives entries as
    [L, n, K, E].
    """

    pages: tuple[jax.Array, ...]  # L arrays [P, ps, 2K, E]
    block_tables: jax.Array  # int32 [S, N]
    lengths: jax.Array  # int32 [S]

    @property
    def num_slots(self) -> int:
        return self.block_tables.shape[0]

    @property
    def page_size(self) -> int:
        return self.pages[0].shape[1]

    @property
    def capacity(self) -> int:
        return self.block_tables.shape[1] * self.page_size

    @property
    def dtype(self):
        return self.pages[0].dtype

    def read(self, slot, positions) -> tuple[jax.Array, jax.Array]:
        """K and V of `slot` at `positions` (int [n]), each [L, n, K, E]."""
        positions = jnp.asarray(positions)
        page = self.block_tables[slot, positions // self.page_size]  # [n]
        at = jnp.stack([p[page, positions % self.page_size] for p in self.pages])  # [L, n, 2K, E]
        return at[:, :, 0::2], at[:, :, 1::2]

    def replace(self, **kw) -> "PagedKVCache":
        return dataclasses.replace(self, **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardExtras:
    """Hidden states the drafter needs, for every token of the call."""

    taps: jax.Array  # [T, N, D] raw outputs (residual stream) of cfg.tap_layers
    final_hidden: jax.Array  # [T, D] after the final RMSNorm


def init_cache(cfg: LlamaConfig, num_slots: int, capacity: int, dtype: Any = jnp.float32) -> KVCache:
    """An empty cache: `num_slots` slots of `capacity` positions each, all lengths 0."""
    L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    return KVCache(k=tuple(jnp.zeros((num_slots, K, E, capacity), dtype) for _ in range(L)),
                   v=tuple(jnp.zeros((num_slots, K, capacity, E), dtype) for _ in range(L)),
                   lengths=jnp.zeros((num_slots,), jnp.int32))


def init_paged_cache(cfg: LlamaConfig, num_slots: int, *, num_pages: int, page_size: int, pages_per_slot: int,
                     dtype: Any = jnp.float32, block_tables: jax.Array | None = None) -> PagedKVCache:
    """An empty paged cache: ``num_pages`` pages of ``page_size`` tokens per layer, a block table of
    ``pages_per_slot`` pages per slot (default: every entry page 0, to be filled by the host's allocator).

    >>> c = init_paged_cache(LlamaConfig.tiny(), 2, num_pages=4, page_size=8, pages_per_slot=2)
    >>> c.pages[0].shape, c.capacity
    ((4, 8, 4, 8), 16)
    """
    L, K, E = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    if block_tables is None:
        block_tables = jnp.zeros((num_slots, pages_per_slot), jnp.int32)
    return PagedKVCache(pages=tuple(jnp.zeros((num_pages, page_size, 2 * K, E), dtype) for _ in range(L)),
                        block_tables=jnp.asarray(block_tables, jnp.int32), lengths=jnp.zeros((num_slots,), jnp.int32))


def commit(cache: KVCache, slots: jax.Array, new_lengths: jax.Array) -> KVCache:
    """Commit an accepted prefix: set lengths[slots] = new_lengths (the K/V are already written).

    Args:
        cache: the cache.
        slots: int [R] slot indices (an index >= num_slots is ignored, so padded rows are harmless).
        new_lengths: int [R] committed token count of each of those slots.
    Returns:
        the cache with moved lengths; K/V untouched.
    """
    lengths = cache.lengths.at[slots].set(jnp.asarray(new_lengths, jnp.int32), mode="drop")
    return cache.replace(lengths=lengths)


def init_random_weights(cfg: LlamaConfig, key: jax.Array, dtype: Any = jnp.float32,
                        scale: float = 0.02) -> LlamaWeights:
    """Random weights for `cfg` (normal(0, scale) projections, norms near 1): for tests of shapes and masks."""
    L, D, F, V = cfg.n_layers, cfg.dim, cfg.ffn_dim, cfg.vocab_size
    HE, KE = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = dict(wq=(L, D, HE), wk=(L, D, KE), wv=(L, D, KE), wo=(L, HE, D), w_gate=(L, D, F),
                  w_up=(L, D, F), w_down=(L, F, D))
    keys = jax.random.split(key, len(shapes) + 5)
    proj = {name: (scale * jax.random.normal(k, shp)).astype(dtype)
            for (name, shp), k in zip(shapes.items(), keys)}
    norm = lambda k, shp: (1.0 + 0.1 * jax.random.normal(k, shp)).astype(dtype)
    stacks = dict(attn_norm=norm(keys[-5], (L, D)), mlp_norm=norm(keys[-4], (L, D)), **proj)  # [L, ...] each
    if cfg.qk_norm:
        k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
        stacks.update(q_norm=norm(k1, (L, cfg.head_dim)), k_norm=norm(k2, (L, cfg.head_dim)))
    if cfg.attn_bias:
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, 2), 3)
        bias = lambda k, n: (scale * jax.random.normal(k, (L, n))).astype(dtype)
        stacks.update(bq=bias(kq, HE), bk=bias(kk, KE), bv=bias(kv, KE))
    layers = tuple(LayerWeights(**{name: a[i] for name, a in stacks.items()}) for i in range(L))
    embed = jax.random.normal(keys[-3], (V, D)).astype(dtype)
    lm_head = None if cfg.tie_embeddings else (scale * jax.random.normal(keys[-1], (D, V))).astype(dtype)
    return LlamaWeights(embed=embed, layers=layers, final_norm=norm(keys[-2], (D,)), lm_head=lm_head)


@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def _prepare_layer(w: jax.Array, dtype: Any, transpose: bool) -> jax.Array:
    """w cast to dtype (and transposed when asked), on the device."""
    return (w.T if transpose else w).astype(dtype)


def layer_arrays(read, n_layers: int, dtype: Any, *, transpose: bool = False) -> list[jax.Array]:
    """One weight of every layer as L device arrays, read one layer at a time.

    Each layer's tensor is moved to the device as it is, then cast (and transposed) there, so the host holds
    one layer's tensor at a time, in its stored dtype. One small program compiles per tensor shape.

    Args:
      read: read(i) -> layer i's tensor (numpy or jax array, any float dtype).
      n_layers: L.
      dtype: the arrays' dtype.
      transpose: store each 2-D tensor transposed (Hugging Face's [out, in] -> this project's [in, out]).
    Returns:
      a list of L arrays in `dtype`.

    >>> [a.shape for a in layer_arrays(lambda i: np.full((2, 3), i, np.float32), 2, jnp.bfloat16, transpose=True)]
    [(3, 2), (3, 2)]
    """
    return [_prepare_layer(jnp.asarray(read(i)), jnp.dtype(dtype), transpose) for i in range(n_layers)]


# ----------------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary inverse frequencies float32 [E/2]: base^(-2i/E), rescaled by `scaling` when given.

    >>> rope_frequencies(4, 10000.0).tolist()
    [1.0, 0.009999999776482582]
    """
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))  # [E/2]
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths divided by factor, short ones kept, the band between blended linearly in
    # original_max_positions / wavelength.
    old = float(scaling.original_max_positions)
    wavelen = 2 * jnp.pi / inv_freq
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = jnp.where(wavelen > old / low, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return jnp.where(medium, blended, out)


def rope(x: jax.Array, positions: jax.Array, base: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding in the rotate-half layout (pairs (i, i + E/2)).

    Args:
        x: [T, heads, E].
        positions: int [T].
        base: the RoPE base (theta).
        scaling: optional frequency scaling (`RopeScaling`).
    Returns:
        [T, heads, E], same dtype.
    """
    half = x.shape[-1] // 2
    inv_freq = rope_frequencies(x.shape[-1], base, scaling)  # [E/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, E/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def masked_softmax(scores: jax.Array, mask: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax of float32 scores over `axis` where mask; a row with nothing visible gives zeros, not NaN."""
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(mask, jnp.exp(scores - top), 0.0)
    denom = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(denom > 0, denom, 1.0)


def first_argmax(x: jax.Array) -> jax.Array:
    """Index of the first maximum over the last axis, int32 [...] from [..., N]: what ``jnp.argmax`` gives
    (the first NaN in a row that holds one), computed as two plain reductions (a max, then the least index that
    attains it), which XLA's CPU backend runs several times faster than argmax's variadic (value, index)
    reduction.

    >>> first_argmax(jnp.array([[0.0, 2.0, 2.0], [5.0, 1.0, 0.0]])).tolist()
    [1, 0]
    """
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN where a row holds one: then the first NaN, as jnp.argmax
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, idx, x.shape[-1]), axis=-1).astype(jnp.int32)


def logits_from_hidden(weights: LlamaWeights, hidden: jax.Array) -> jax.Array:
    """LM head: [..., D] final hidden -> [..., V] float32 logits.

    The head's [V, D] (or [D, V]) array is an operand in its own dtype, the product accumulated in float32
    (``preferred_element_type``): a bf16 model never makes a float32 copy of its LM head."""
    h = hidden.astype(weights.embed.dtype)
    if weights.lm_head is None:  # tied: contract with the embedding's rows (a transpose of it would be copied)
        return jnp.einsum("...d,vd->...v", h, weights.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", h.astype(weights.lm_head.dtype), weights.lm_head,
                      preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------
# The forward


def _forward(weights: LlamaWeights, cache: KVCache | PagedKVCache, tokens: jax.Array, slots: jax.Array,
             positions: jax.Array, valid: jax.Array, cfg: LlamaConfig, *, reads: str, max_per_slot: int = 1,
             row_slots: jax.Array | None = None, context: int | None = None, attention_impl: str = "auto"
             ) -> tuple[ForwardExtras, KVCache | PagedKVCache]:
    """Shared body of the entry points: writes K/V of valid tokens, attends, returns hidden states.

    `reads` (static) says how a token finds its slot's cache, so that no more of the cache is read than needed:
      "one_slot": every token belongs to slots[0]: the slot is read once (prefill); "one_slot_masked" the
        same, read by a masked sum over the slot axis (a cache whose slots are split over devices);
      "grid": at most `max_per_slot` (M) tokens per slot: the queries are placed on an [S, M] grid and attend
        to the layer's cache as it is, with no copy of it (decode with M = 1, packed verification);
      "per_token": any number of tokens per slot: each token gathers its slot's [K, E, C] cache, a copy that
        grows with T * C (packed verification without a bound M).
    With "grid", `row_slots` (int [R], static R) restricts the grid to those slots: their caches are gathered
    (R rows instead of all S), so the cost follows the number of active requests; tokens of other slots are
    not allowed. Without `context`, the caches are read in parts up to the call's longest position
    (`over_context`): the cost follows the context held, in one program for every context. `context` (static)
    reads only cache positions [0, context) in one part instead (every valid position must lie below it).

    A `PagedKVCache` is written through its block table and read on the same XLA path on a CPU, by
    `kernels.ragged_paged_attention` elsewhere or when ``attention_impl`` (static) names an implementation: the
    same tokens see the same positions.
    """
    T = tokens.shape[0]
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    dtype = weights.embed.dtype
    if isinstance(cache, PagedKVCache) and (attention_impl != "auto" or jax.default_backend() != "cpu"):
        layer_caches, kv_step = _paged_kv_step(cache, slots, positions, valid, cfg, reads=reads, max_per_slot=max_per_slot,
                                               row_slots=row_slots, context=context, impl=attention_impl)
    else:
        layer_caches, kv_step = _xla_kv_step(cache, slots, positions, valid, cfg, reads=reads,
                                             max_per_slot=max_per_slot, row_slots=row_slots, context=context)

    def layer(x, lw: LayerWeights, layer_cache):
        h = rms_norm(x, lw.attn_norm, cfg.norm_eps)
        q, k, v = h @ lw.wq, h @ lw.wk, h @ lw.wv  # [T, H*E], [T, K*E], [T, K*E]
        if cfg.attn_bias:
            q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
        q, k, v = q.reshape(T, H, E), k.reshape(T, K, E), v.reshape(T, K, E)
        if cfg.qk_norm:
            q, k = rms_norm(q, lw.q_norm, cfg.norm_eps), rms_norm(k, lw.k_norm, cfg.norm_eps)
        q = rope(q, positions, cfg.rope_base, cfg.rope_scaling)  # [T, H, E]
        k = rope(k, positions, cfg.rope_base, cfg.rope_scaling)  # [T, K, E]
        attn, layer_cache = kv_step(q, k, v, layer_cache)  # [T, H, E]: the new K/V written, then attended to
        x = x + attn.reshape(T, H * E).astype(dtype) @ lw.wo
        h = rms_norm(x, lw.mlp_norm, cfg.norm_eps)
        x = x + (jax.nn.silu(h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down
        return x, layer_cache

    x = weights.embed[tokens]  # [T, D]
    new_caches, outs = [], []
    for lw, layer_cache in zip(weights.layers, layer_caches, strict=True):  # unrolled: see module doc
        x, layer_cache = layer(x, lw, layer_cache)
        new_caches.append(layer_cache)
        outs.append(x)
    taps = jnp.stack([outs[i] for i in cfg.tap_layers], axis=1)  # [T, N, D]
    extras = ForwardExtras(taps=taps, final_hidden=rms_norm(x, weights.final_norm, cfg.norm_eps))
    if isinstance(cache, PagedKVCache):
        return extras, cache.replace(pages=tuple(new_caches))
    return extras, cache.replace(k=tuple(k for k, _ in new_caches), v=tuple(v for _, v in new_caches))


def context_plan(span: int, *, unit: int = 1, step: int = CONTEXT_STEP,
                 chunk: int = ATTENTION_CHUNK) -> tuple[int, int, tuple[int, ...]]:
    """How `over_context` reads a cache of ``span`` positions: (step, chunk, tail sizes), every size a multiple
    of ``unit`` (a page) and at most ``span``.

    >>> context_plan(8192), context_plan(64)
    ((128, 512, (128, 256, 384, 512)), (64, 64, (64,)))
    """
    step = min(-(-step // unit) * unit, span)
    chunk = max(step, min(chunk, span) // step * step)
    return step, chunk, tuple(range(step, chunk + 1, step))


def over_context(part, carry, bound, span: int, *, unit: int = 1, static: bool = False):
    """Fold ``part(read, start, size, carry) -> carry`` over cache positions [0, bound) in parts, so that the
    cost follows ``bound`` (an array: the longest context of the call), not ``span`` (the capacity).

    One ``lax.switch`` per call picks the reads: contexts that fit one chunk (`ATTENTION_CHUNK` positions) read
    one part of the smallest multiple of `CONTEXT_STEP` that holds them, what a static window of that rounding
    reads; longer ones read whole chunks in a ``lax.while_loop``, then the rest in steps (a second loop). One
    program serves every context. ``part`` reads positions [read, read + size) (``size`` static) and must ignore
    those below ``start``: ``read < start`` only where the span's end clamps a part back over positions an
    earlier part took. ``static``: one part over the whole span (a static window), no control flow.

    Args:
      part: the attention of one part folded into the running state.
      carry: the running state (`online_softmax_step`'s sums and the weighted values).
      bound: int32 [] no query sees a position at or past it.
      span: static positions the cache holds (reads stay below it); unit: static, every read's start and size
        are multiples of it (a page).
    Returns:
      the carry after the parts.
    """
    if static:
        return part(0, 0, span, carry)
    step, chunk, sizes = context_plan(span, unit=unit)
    total = jnp.minimum((jnp.maximum(bound, 1) + step - 1) // step * step, span)  # positions to read

    def run(start, size, carry):
        return part(jnp.minimum(start, span - size), start, size, carry)

    def short(size, carry):  # [0, total) in one part
        return run(jnp.int32(0), size, carry)

    branches = [functools.partial(short, size) for size in sizes]
    if span > chunk:
        def long(carry):  # whole chunks, then steps
            full = total // chunk
            carry = lax.fori_loop(0, full, lambda i, c: run(i * chunk, chunk, c), carry)
            return lax.fori_loop(0, (total - full * chunk + step - 1) // step,
                                 lambda i, c: run(full * chunk + i * step, step, c), carry)

        branches.append(long)
    if len(branches) == 1:
        return branches[0](carry)
    index = jnp.minimum((total + step - 1) // step - 1, len(branches) - 1)  # past the sizes: the long branch
    return lax.switch(index, branches, carry)


def online_softmax_step(top, denom, scores, visible):
    """One part of a softmax taken over parts of its axis (online softmax), in float32.

    Args:
      top, denom: [..., 1] the running maximum (-inf before any visible score) and sum of the earlier parts.
      scores: float32 [..., n] this part's scores; visible: bool, broadcastable to ``scores``.
    Returns:
      (top, denom) after this part, the part's weights ``exp(scores - top)`` [..., n] (0 where not visible),
      and the factor [..., 1] that rescales the earlier parts' weighted sums to the new maximum. A row that has
      seen nothing keeps top -inf, denom 0 (divide by ``where(denom > 0, denom, 1)``: zeros, not NaN).
    """
    scores = jnp.where(visible, scores, -jnp.inf)
    # the result does not depend on the shift: no gradient flows through it
    new_top = lax.stop_gradient(jnp.maximum(top, jnp.max(scores, axis=-1, keepdims=True)))
    shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    weights = jnp.exp(scores - shift)  # exp(-inf) = 0 where not visible
    keep = jnp.exp(top - shift)
    return new_top, denom * keep + jnp.sum(weights, axis=-1, keepdims=True), weights, keep


def _xla_kv_step(cache: KVCache | PagedKVCache, slots, positions, valid, cfg: LlamaConfig, *, reads: str,
                 max_per_slot: int, row_slots, context: int | None):
    """The XLA path's per-layer step for `_forward` (slot caches, and page pools on the CPU): (the layers'
    caches, step), where ``step(q [T, H, E], k, v [T, K, E], layer_cache) -> (attention [T, H, E] float32,
    layer_cache)`` writes the tokens' K/V and attends over the caches as ``reads`` says, reading the context in
    parts up to the call's longest (`over_context`), or over a static ``context`` window when one is given."""
    T = slots.shape[0]
    paged = isinstance(cache, PagedKVCache)
    S = cache.num_slots
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    Q, M = H // K, max_per_slot
    f32 = jnp.float32
    unit = cache.page_size if paged else 1
    span = cache.capacity if context is None else min(-(-int(context) // unit) * unit, cache.capacity)
    bound = jnp.max(jnp.where(valid, positions, 0)) + 1  # [] no token sees a position at or past it

    read_slots = jnp.clip(slots, 0, S - 1)
    if paged:
        write_at = kernels.slot_mapping(cache.block_tables, jnp.where(valid, read_slots, -1), positions, unit)
    else:
        write_slots = jnp.where(valid, slots, S)  # out of range: mode="drop" writes nothing for padding
        write_positions = positions
        if T == 1:
            # A scatter of one index becomes a dynamic-update-slice, around which XLA:CPU copies every layer's
            # cache of a one-slot cache (4 copies per layer; a 1-slot decode step took 1.6x a 2-slot one). A
            # second, dropped index keeps it a scatter.
            write_slots = jnp.concatenate([write_slots, jnp.full((1,), S, jnp.int32)])
            write_positions = jnp.concatenate([positions, jnp.zeros((1,), positions.dtype)])
    token_pos = jnp.where(valid, positions, -1)  # a padding token sees nothing
    if reads == "grid":
        # Token t goes to cell row * M + (number of earlier valid tokens of its row); padding to R * M (dropped).
        grid_slots = jnp.arange(S, dtype=jnp.int32) if row_slots is None else row_slots.astype(jnp.int32)
        G = grid_slots.shape[0]  # grid rows
        onehot = (slots[:, None] == grid_slots[None, :]) & valid[:, None]  # [T, G]
        token_row = jnp.argmax(onehot, axis=1)  # [T]
        rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), token_row[:, None], axis=1)[:, 0] - 1  # [T]
        placed = valid & jnp.any(onehot, axis=1) & (rank < M)
        cell = jnp.where(placed, token_row * M + rank, G * M)  # [T]
        cell_pos = jnp.full((G * M,), -1, jnp.int32).at[cell].set(positions, mode="drop")  # [G*M]
        query_pos = cell_pos.reshape(G, 1, M, 1, 1)  # [B, K, R, Q, 1]: each query row's position
        rows = None if (row_slots is None and not paged) else grid_slots  # None: every slot read in place
    elif reads in ("one_slot", "one_slot_masked"):
        query_pos = token_pos[None, None, :, None, None]
        rows = read_slots[:1]
    else:  # per_token: every token reads its slot's cache
        query_pos = token_pos[:, None, None, None, None]
        rows = read_slots
    tables = cache.block_tables[rows] if paged else None  # [B, N]

    def read_kv(layer_cache, read, size):
        """Keys [B, K, E, size] and values [B, K, size, E] of the rows at positions [read, read + size)."""
        if paged:
            kv = layer_cache[lax.dynamic_slice_in_dim(tables, read // unit, size // unit, axis=1)]  # [B, n, ps, 2K, E]
            kv = kv.reshape(kv.shape[0], size, K, 2, E)
            return kv[:, :, :, 0].transpose(0, 2, 3, 1), kv[:, :, :, 1].transpose(0, 2, 1, 3)
        k_cache, v_cache = layer_cache
        if reads == "one_slot":
            return (lax.dynamic_slice(k_cache, (rows[0], 0, 0, read), (1, K, E, size)),
                    lax.dynamic_slice(v_cache, (rows[0], 0, read, 0), (1, K, size, E)))
        keys = lax.dynamic_slice_in_dim(k_cache, read, size, axis=3)  # [S, K, E, size]
        values = lax.dynamic_slice_in_dim(v_cache, read, size, axis=2)  # [S, K, size, E]
        if reads == "one_slot_masked":  # the slot picked by a masked sum over the slot axis (see prefill)
            pick = (jnp.arange(S) == rows[0])[:, None, None, None]
            return jnp.where(pick, keys, 0).sum(0)[None], jnp.where(pick, values, 0).sum(0)[None]
        if rows is None:
            return keys, values
        return (jax.vmap(lambda r: lax.dynamic_slice(k_cache, (r, 0, 0, read), (1, K, E, size))[0])(rows),
                jax.vmap(lambda r: lax.dynamic_slice(v_cache, (r, 0, read, 0), (1, K, size, E))[0])(rows))

    def attend(q, layer_cache):
        """q [T, K, Q, E] (scaled, in the cache's dtype) -> [T, K, Q, E] float32.

        Every product is laid out as a batched matrix product with the batch axes leading (XLA's CPU dot is
        several times slower otherwise).
        """
        if reads == "grid":
            grid = jnp.zeros((G * M, K, Q, E), q.dtype).at[cell].set(q, mode="drop")
            rows_q = grid.reshape(G, M, K, Q, E).transpose(0, 2, 1, 3, 4)  # [G, K, M, Q, E]
        elif reads == "per_token":
            rows_q = q[:, :, None]  # [T, K, 1, Q, E]
        else:
            rows_q = q.transpose(1, 0, 2, 3)[None]  # [1, K, T, Q, E]
        B, _, R = rows_q.shape[:3]
        flat_q = rows_q.reshape(B, K, R * Q, E)

        def part(read, start, size, carry):
            top, denom, acc = carry
            keys, values = read_kv(layer_cache, read, size)
            pos = read + jnp.arange(size, dtype=jnp.int32)
            visible = (pos <= query_pos) & (pos >= start)  # [B, K, R, Q, size]
            scores = jnp.einsum("bkre,bkec->bkrc", flat_q, keys, preferred_element_type=f32)
            top, denom, weights, keep = online_softmax_step(top, denom, scores.reshape(B, K, R, Q, size), visible)
            pv = jnp.einsum("bkrc,bkce->bkre", weights.reshape(B, K, R * Q, size).astype(values.dtype), values,
                            preferred_element_type=f32)
            return top, denom, acc * keep.reshape(B, K, R * Q, 1) + pv

        init = (jnp.full((B, K, R, Q, 1), -jnp.inf, f32), jnp.zeros((B, K, R, Q, 1), f32),
                jnp.zeros((B, K, R * Q, E), f32))
        _, denom, acc = over_context(part, init, bound, span, unit=unit, static=context is not None)
        out = acc.reshape(B, K, R, Q, E) / jnp.where(denom > 0, denom, 1.0)
        if reads == "per_token":
            return out[:, :, 0]
        if reads in ("one_slot", "one_slot_masked"):
            return out[0].transpose(1, 0, 2, 3)
        out = out.transpose(0, 2, 1, 3, 4).reshape(G * M, K, Q, E)[jnp.minimum(cell, G * M - 1)]  # [T, K, Q, E]
        return jnp.where(placed[:, None, None, None], out, 0.0)

    def step(q, k, v, layer_cache):
        if paged:
            layer_cache = kernels.write_kv(layer_cache, k, v, write_at)
            dtype = layer_cache.dtype
        else:
            k_cache, v_cache = layer_cache
            # Both updates are [T, K, E]: k_cache [S, K, E, C], v_cache [S, K, C, E].
            k_new, v_new = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
            if T == 1:  # the dropped second index (above)
                k_new, v_new = jnp.concatenate([k_new, k_new]), jnp.concatenate([v_new, v_new])
            k_cache = k_cache.at[write_slots, :, :, write_positions].set(k_new, mode="drop")
            v_cache = v_cache.at[write_slots, :, write_positions].set(v_new, mode="drop")
            layer_cache, dtype = (k_cache, v_cache), k_cache.dtype
        # scaled in float32 (a [T, H, E] tensor), then an operand in the cache's dtype: the cache is never cast
        q = (q.reshape(T, K, Q, E).astype(f32) * (E ** -0.5)).astype(dtype)
        return attend(q, layer_cache).reshape(T, H, E), layer_cache

    layer_caches = list(cache.pages) if paged else list(zip(cache.k, cache.v, strict=True))
    return layer_caches, step


def _paged_kv_step(cache: PagedKVCache, slots, positions, valid, cfg: LlamaConfig, *, reads: str,
                   max_per_slot: int, row_slots, context: int | None, impl: str):
    """The paged layout's per-layer step for `_forward` (as `_slot_kv_step`): the tokens' K/V written through
    the block table (`kernels.write_kv`), then `kernels.ragged_paged_attention` over one metadata set shared by
    every layer. The tokens are put in sequence order for the kernel (packed rows per sequence) and back.

    Sequences: ``one_slot*`` (prefill): the one slot, its valid tokens first; ``grid``: the grid's slots (all,
    or ``row_slots``), each with its placed tokens (at most ``max_per_slot``); ``per_token``: every token its
    own sequence (of one query). Each sequence's cached length is its last token's position + 1 (the contract:
    a slot's new tokens continue its committed prefix).
    """
    T = slots.shape[0]
    S, ps = cache.num_slots, cache.page_size
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    C = cache.capacity if context is None else min(int(context), cache.capacity)
    window = -(-C // ps) * ps  # the XLA path's gather: whole pages
    read_slots = jnp.clip(slots, 0, S - 1)
    seq_of_write = jnp.where(valid, read_slots, -1)
    write_at = kernels.slot_mapping(cache.block_tables, seq_of_write, positions, ps)  # [T] flat pool slots
    if reads in ("one_slot", "one_slot_masked"):
        n_new = jnp.sum(valid).astype(jnp.int32)
        seq_slots = read_slots[:1]  # [1]
        q_len = n_new[None]
        dest = jnp.where(valid, jnp.cumsum(valid) - 1, T)  # valid tokens first, in order
        M = T
    elif reads == "grid":
        seq_slots = jnp.arange(S, dtype=jnp.int32) if row_slots is None else row_slots.astype(jnp.int32)
        onehot = (slots[:, None] == seq_slots[None, :]) & valid[:, None]  # [T, R]
        token_row = jnp.argmax(onehot, axis=1)  # [T]
        rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), token_row[:, None], axis=1)[:, 0] - 1  # [T]
        placed = valid & jnp.any(onehot, axis=1) & (rank < max_per_slot)
        q_len = jnp.sum(onehot & placed[:, None], axis=0).astype(jnp.int32)  # [R]
        starts = jnp.cumsum(q_len) - q_len
        dest = jnp.where(placed, starts[token_row] + rank, T)
        M = max_per_slot
    else:  # per_token
        seq_slots = read_slots
        q_len = valid.astype(jnp.int32)
        dest = jnp.where(valid, jnp.cumsum(valid) - 1, T)
        M = 1
    R = seq_slots.shape[0]
    token_seq = (jnp.zeros((T,), jnp.int32) if reads in ("one_slot", "one_slot_masked")
                 else token_row if reads == "grid" else jnp.arange(T, dtype=jnp.int32))
    kv_lens = jnp.zeros((R,), jnp.int32).at[jnp.where(dest < T, token_seq, R)].max(positions + 1, mode="drop")
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_len).astype(jnp.int32)])
    meta = (kv_lens, cache.block_tables[seq_slots], cu_q_lens, jnp.full((1,), R, jnp.int32))
    # On a device mesh made current (`jax.set_mesh`, as the engine does), a kernel runs per device over the mesh
    # axis the pool's KV heads split over (`kernels.per_device`; sharding's rules, imported here at call time:
    # sharding imports this module).
    from dspark_jax.sharding import RULES  # noqa: PLC0415

    head_axis = RULES.mesh_axis("kv_pairs")

    def step(q, k, v, pages):
        pages = kernels.write_kv(pages, k, v, write_at)
        packed = jnp.zeros((T, H, E), pages.dtype).at[dest].set(q.astype(pages.dtype), mode="drop")  # [T, H, E]
        out = kernels.ragged_paged_attention(packed, pages, *meta, sm_scale=E**-0.5, max_q_per_seq=M,
                                             window=window, impl=impl, head_axis=head_axis)
        return jnp.where((dest < T)[:, None, None], out[jnp.minimum(dest, T - 1)], 0), pages

    return list(cache.pages), step


@functools.partial(jax.jit, static_argnames=("cfg", "max_per_slot", "context"), donate_argnames=("cache",))
def forward_packed(weights: LlamaWeights, cache: KVCache, tokens: jax.Array, slots: jax.Array,
                   positions: jax.Array, valid: jax.Array, cfg: LlamaConfig, max_per_slot: int | None = None,
                   row_slots: jax.Array | None = None, context: int | None = None
                   ) -> tuple[jax.Array, ForwardExtras, KVCache]:
    """Packed verification: a flat batch of tokens from many slots in one forward.

    Every valid token writes its K/V at cache[slot, position] and attends to its own slot's entries at
    positions <= its own: the committed prefix plus the earlier new tokens of the same slot written in this
    call. Contract (not checked inside jit; see `check_packed`): a slot's new tokens have distinct positions
    that continue its committed prefix (lengths[slot], lengths[slot] + 1, ...) and stay below the capacity.
    Padding tokens (valid False) write nothing; their outputs are to be ignored.
    `cache.lengths` is not changed: commit the accepted prefix afterwards (`commit`). The cache is donated.

    Attention cost: with `max_per_slot` = M (static; e.g. the block size + 1), the queries are laid on an
    [S, M] grid that reads each slot's cache in place, so the cost is S * M * C; a slot with more than M valid
    tokens breaks the contract (its extra tokens get zero attention). Without it, every token gathers its slot's
    cache, a copy of T * C entries per layer (general, and slower for large T).

    Args:
        weights: model weights.
        cache: KVCache (per layer: k [S, K, E, C], v [S, K, C, E]).
        tokens: int [T] token ids (T static: pad to `bucket_for`).
        slots: int [T] slot of each token.
        positions: int [T] position of each token in its slot.
        valid: bool [T] False for padding.
        cfg: static config.
        max_per_slot: static bound on the valid tokens of one slot in this call, or None.
        row_slots: optional int [R] (with max_per_slot): the only slots that hold valid tokens; the grid then
            has R rows and reads only those slots' caches (the cost follows the active requests, not S).
        context: optional static bound: every valid position is below it, and only cache positions
            [0, context) are read (the cost follows the context held, not the capacity; see `context_bucket`).
    Returns:
        logits float32 [T, V], ForwardExtras (taps [T, N, D], final_hidden [T, D]), the cache with K/V written.

    >>> cfg = LlamaConfig.tiny()
    >>> w, c = init_random_weights(cfg, jax.random.key(0)), init_cache(cfg, 2, 16)
    >>> logits, extras, c = forward_packed(w, c, jnp.array([3, 4, 5, 0]), jnp.array([0, 0, 1, 0]),
    ...                                    jnp.array([0, 1, 0, 0]), jnp.array([True, True, True, False]), cfg)
    >>> logits.shape, extras.taps.shape
    ((4, 64), (4, 5, 32))
    """
    if max_per_slot is None:
        if row_slots is not None:
            raise ValueError("row_slots needs max_per_slot (the grid layout)")
        extras, cache = _forward(weights, cache, tokens, slots, positions, valid, cfg, reads="per_token",
                                 context=context)
    else:
        extras, cache = _forward(weights, cache, tokens, slots, positions, valid, cfg, reads="grid",
                                 max_per_slot=max_per_slot, row_slots=row_slots, context=context)
    return logits_from_hidden(weights, extras.final_hidden), extras, cache


@functools.partial(jax.jit, static_argnames=("cfg", "sharded_slots"), donate_argnames=("cache",))
def prefill(weights: LlamaWeights, cache: KVCache, tokens: jax.Array, slot: jax.Array, start: jax.Array,
            n_valid: jax.Array, cfg: LlamaConfig, sharded_slots: bool = False
            ) -> tuple[jax.Array, ForwardExtras, KVCache]:
    """Prefill one chunk of a prompt into a slot and commit it.

    ``sharded_slots`` (static): the cache's slot axis is split over devices (data parallelism). The slot's
    cache is then read by a masked sum over the slot axis, whose partial sums meet in an all-reduce of one
    slot's rows; read by index, XLA gathers every slot's cache of every layer onto every device first.

    Args:
        tokens: int [P] chunk (P static, one of PREFILL_CHUNKS; the tail beyond n_valid is padding).
        slot: int scalar slot index.
        start: int scalar position of tokens[0]; the slot's first `start` entries are its committed prefix.
        n_valid: int scalar, 1 <= n_valid <= P, and start + n_valid <= capacity.
    Returns:
        logits float32 [V] of the last valid token, ForwardExtras for all P chunk tokens (padding rows are
        garbage), and the cache with lengths[slot] = start + n_valid.
    """
    P = tokens.shape[0]
    idx = jnp.arange(P, dtype=jnp.int32)
    slots = jnp.full((P,), slot, jnp.int32)
    extras, cache = _forward(weights, cache, tokens, slots, start + idx, idx < n_valid, cfg,
                             reads="one_slot_masked" if sharded_slots else "one_slot")
    last = lax.dynamic_index_in_dim(extras.final_hidden, n_valid - 1, keepdims=False)  # [D]
    cache = cache.replace(lengths=cache.lengths.at[slot].set(start + n_valid))
    return logits_from_hidden(weights, last), extras, cache


@functools.partial(jax.jit, static_argnames=("cfg", "context"), donate_argnames=("cache",))
def decode_step(weights: LlamaWeights, cache: KVCache, tokens: jax.Array, active: jax.Array,
                cfg: LlamaConfig, context: int | None = None) -> tuple[jax.Array, ForwardExtras, KVCache]:
    """Plain decode: one token per active slot at position lengths[slot], then lengths += active.

    Args:
        tokens: int [S] the next token of each slot (ignored where not active).
        active: bool [S].
        context: optional static bound above every active slot's length; only cache positions below it
            are read (see `context_bucket`).
    Returns:
        logits float32 [S, V], ForwardExtras ([S, N, D], [S, D]), the cache (donated) with lengths advanced.
    """
    S = cache.num_slots
    slots = jnp.arange(S, dtype=jnp.int32)
    extras, new_cache = _forward(weights, cache, tokens, slots, cache.lengths, active, cfg, reads="grid",
                                 context=context)
    new_cache = new_cache.replace(lengths=cache.lengths + active.astype(jnp.int32))
    return logits_from_hidden(weights, extras.final_hidden), extras, new_cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_slot(cache: KVCache, src: jax.Array, dst: jax.Array, length: jax.Array) -> KVCache:
    """Slot ``dst`` takes slot ``src``'s first ``length`` positions as its committed prefix (prompt sharing:
    K/V at a position depend only on the tokens up to it, so a prompt prefilled once serves every answer to it).

    The whole row is copied; entries at ``length`` and beyond are uncommitted and get overwritten before they are
    visible. The cache is donated.

    Args:
      src, dst: int scalar slots (may be equal). length: int scalar, at most ``lengths[src]`` for a valid prefix.
    Returns:
      The cache with ``lengths[dst] = length``.

    >>> cfg = LlamaConfig.tiny()
    >>> c = init_cache(cfg, 2, 16)
    >>> c = copy_slot(c.replace(k=tuple(k.at[0].set(1.0) for k in c.k)), 0, 1, 5)
    >>> float(min(k[1].min() for k in c.k)), c.lengths.tolist()
    (1.0, [0, 5])
    """
    def copy(a):  # [S, ...]: row dst = row src
        return lax.dynamic_update_index_in_dim(a, lax.dynamic_index_in_dim(a, src, 0, keepdims=False), dst, 0)

    return cache.replace(k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v)),
                         lengths=cache.lengths.at[dst].set(length))


def check_packed(cache: KVCache, tokens, slots, positions, valid, max_per_slot: int | None = None) -> None:
    """Validate a packed batch on the host (un-jitted): raises ValueError naming the argument."""
    tokens, slots, positions, valid = (np.asarray(a) for a in (tokens, slots, positions, valid))
    T = tokens.shape[0] if tokens.ndim == 1 else None
    for name, a in (("tokens", tokens), ("slots", slots), ("positions", positions), ("valid", valid)):
        if a.ndim != 1 or a.shape[0] != T:
            raise ValueError(f"{name} must have shape [T] with T = len(tokens) = {T}; got {a.shape}")
    S, C = cache.num_slots, cache.capacity
    v = valid.astype(bool)
    if np.any((slots[v] < 0) | (slots[v] >= S)):
        raise ValueError(f"slots of valid tokens must lie in [0, {S}); got {slots[v].tolist()}")
    if np.any((positions[v] < 0) | (positions[v] >= C)):
        raise ValueError(f"positions of valid tokens must lie in [0, capacity={C}); got {positions[v].tolist()}")
    lengths = np.asarray(cache.lengths)
    for s in np.unique(slots[v]):
        pos = np.sort(positions[v & (slots == s)])
        expect = np.arange(lengths[s], lengths[s] + len(pos))
        if not np.array_equal(pos, expect):
            raise ValueError(f"positions of slot {s} must be {expect.tolist()} (continuing its committed length "
                             f"{lengths[s]}); got {pos.tolist()}")
        if max_per_slot is not None and len(pos) > max_per_slot:
            raise ValueError(f"slot {s} has {len(pos)} valid tokens, more than max_per_slot={max_per_slot}")


# ----------------------------------------------------------------------------------------------------
# Python-level convenience: a loaded model with bucketed entry points


def prefill_chunks(n: int, chunks: Sequence[int] = PREFILL_CHUNKS) -> list[tuple[int, int]]:
    """How a prompt of n tokens is cut: (chunk size, tokens taken) pairs, largest chunks first.

    >>> prefill_chunks(300)
    [(256, 256), (64, 44)]
    """
    out = []
    while n > 0:
        size = next((c for c in chunks if c >= n), chunks[-1])
        out.append((size, min(n, size)))
        n -= out[-1][1]
    return out


def prefill_prompt(weights: LlamaWeights, cache: KVCache, prompt_ids: Sequence[int], slot: int,
                   cfg: LlamaConfig, *, start: int = 0, chunks: Sequence[int] = PREFILL_CHUNKS,
                   return_extras: bool = False):
    """Prefill a whole prompt into `slot` by fixed-size chunks; the slot's length becomes start + len(prompt).

    Returns:
        (logits float32 [V] of the last prompt token, ForwardExtras of the prompt tokens ([n, N, D], [n, D]) or
        None unless return_extras, cache). The cache passed in is donated.
    """
    ids = np.asarray(prompt_ids, np.int32)
    n = len(ids)
    if n == 0:
        raise ValueError("prompt_ids must hold at least one token")
    if start + n > cache.capacity:
        raise ValueError(f"prompt of {n} tokens from position {start} exceeds the slot capacity {cache.capacity}")
    taps, finals = [], []
    done = 0
    for size, take in prefill_chunks(n, chunks):
        chunk = np.zeros(size, np.int32)
        chunk[:take] = ids[done:done + take]
        logits, extras, cache = prefill(weights, cache, jnp.asarray(chunk), jnp.int32(slot),
                                        jnp.int32(start + done), jnp.int32(take), cfg)
        if return_extras:
            taps.append(extras.taps[:take])
            finals.append(extras.final_hidden[:take])
        done += take
    extras = (ForwardExtras(taps=jnp.concatenate(taps), final_hidden=jnp.concatenate(finals))
              if return_extras else None)
    return logits, extras, cache


class LlamaModel:
    """A loaded target: config, weights and tokenizer, with the jitted entry points.

    The entry points are the module's jitted functions (compiled once per static shape); this class pads
    packed batches to a bucket and prompts to prefill chunks.
    """

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, tokenizer=None):
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer

    @classmethod
    def from_gguf(cls, path: str | Path | None = None, dtype: Any = jnp.float32) -> "LlamaModel":
        """Load a Llama-family GGUF (default: the cached SmolLM2-135M-Instruct, fetched once)."""
        from dspark_jax.models.gguf import default_model_path, load_gguf
        from dspark_jax.tokenizer import Tokenizer

        path = default_model_path() if path is None else Path(path)
        cfg, weights, meta = load_gguf(path, dtype=dtype)
        return cls(cfg, weights, Tokenizer.from_metadata(meta))

    @property
    def dtype(self):
        return self.weights.embed.dtype

    def init_cache(self, num_slots: int, capacity: int, dtype: Any = None) -> KVCache:
        return init_cache(self.cfg, num_slots, capacity, self.dtype if dtype is None else dtype)

    def prefill(self, cache: KVCache, prompt_ids: Sequence[int], slot: int, *, start: int = 0,
                return_extras: bool = False):
        """See `prefill_prompt`."""
        return prefill_prompt(self.weights, cache, prompt_ids, slot, self.cfg, start=start,
                              return_extras=return_extras)

    def decode(self, cache: KVCache, tokens, active, *, context: int | None = None):
        """See `decode_step` (the cache is donated). ``context``: a static bound above every active
        slot's length (use `context_bucket` so that few shapes compile)."""
        return decode_step(self.weights, cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(active, bool),
                           self.cfg, context)

    def verify(self, cache: KVCache, tokens, slots, positions, valid=None, *, max_per_slot: int | None = None,
               check: bool = False):
        """Packed verification padded to `bucket_for(len(tokens))`; returns unpadded logits and extras.

        See `forward_packed` for `max_per_slot`. With check=True the batch is validated on the host first.
        """
        tokens = np.asarray(tokens, np.int32)
        n = len(tokens)
        valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
        if check:
            check_packed(cache, tokens, slots, positions, valid, max_per_slot)
        T = bucket_for(n)
        pad = lambda a, dt: np.concatenate([np.asarray(a, dt), np.zeros(T - n, dt)])
        logits, extras, cache = forward_packed(self.weights, cache, pad(tokens, np.int32), pad(slots, np.int32),
                                               pad(positions, np.int32), pad(valid, bool), self.cfg, max_per_slot)
        extras = ForwardExtras(taps=extras.taps[:n], final_hidden=extras.final_hidden[:n])
        return logits[:n], extras, cache

    def score(self, ids: Sequence[int], capacity: int | None = None) -> jax.Array:
        """Teacher-forced logits float32 [n, V] of a whole sequence (fresh one-slot cache)."""
        n = len(ids)
        cache = self.init_cache(1, capacity or -(-n // 256) * 256)  # rounded up: few distinct cache shapes
        _, extras, _ = self.prefill(cache, ids, 0, return_extras=True)
        return logits_from_hidden(self.weights, extras.final_hidden)
