"""How much of a device's memory the paged KV pool gets: weights, drafter, round workspace, then pages.

Sized as vLLM sizes its pool: a fraction ``gpu_memory_utilization`` of the device's memory holds the target's
weights, the drafter's own parameters (the embedding and LM head it shares with the target are counted once),
the largest round's activations, and the page pool of the rest. Every cached token costs the target's K and V
in every layer plus the drafter's context K and V in every draft layer, both in the cache dtype: the drafter's
pages follow the target's (one block table), so a page holds both.

Shapes only: the weights are `jax.eval_shape`-d (nothing is allocated), so a plan for an 8B model on an 80 GB
device runs anywhere.

On a device mesh (``tensor_parallel_size`` N > 1) the plan is per device of a tensor-parallel group: weights and
cache bytes split over N where `sharding.RULES` splits them (heads, FFN width and vocabulary, the pool's KV heads
where they divide by N; the rest whole on every device). The page pool is replicated over the mesh's ``data``
axis (`sharding.paged_cache_axes`): every data group holds the whole pool, so the pool a plan sizes is one
tensor-parallel group's and data parallelism does not enlarge it. The round workspace stays the unsplit upper
estimate.

Axis legend: L target layers, K KV heads, E head dim, D width, F FFN width, V vocabulary, W draft vocabulary,
G block, T batched tokens of a round.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import sharding
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import LlamaConfig, init_random_weights

__all__ = ["MemoryPlan", "plan_memory", "target_bytes", "drafter_param_bytes", "kv_bytes_per_token"]

GIB = 1024**3


def _nbytes(tree, dtype: Any | None = None) -> int:
    """Bytes of a pytree of arrays or shape structs; floating leaves counted in ``dtype`` when given."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        dt = jnp.dtype(leaf.dtype)
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        total += math.prod(leaf.shape) * dt.itemsize
    return int(total)


def _split(nbytes: int, shape, axes: sharding.Axes, tensor: int, units: dict[str, int]) -> int:
    """Bytes one device of a tensor-parallel group of ``tensor`` holds of an array of ``nbytes`` bytes: a share
    where the rules split one of its axes over ``tensor``, else all of it."""
    if tensor == 1 or sharding.TENSOR not in tuple(sharding.spec_for(shape, axes, {sharding.TENSOR: tensor},
                                                                     units=units)):
        return nbytes
    return nbytes // tensor


def _split_nbytes(tree, axes, tensor: int, units: dict[str, int], dtype: Any | None = None) -> int:
    """`_nbytes` per device of a tensor-parallel group (``axes``: the tree's `sharding.Axes`)."""
    total = 0
    for ax, leaf in zip(jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, sharding.Axes)), jax.tree.leaves(tree),
                        strict=True):
        total += _split(_nbytes(leaf, dtype), leaf.shape, ax, tensor, units)
    return int(total)


def target_bytes(cfg: LlamaConfig, dtype: Any = jnp.bfloat16, tensor_parallel_size: int = 1) -> int:
    """Bytes of the target's weights in ``dtype`` (from shapes alone), per device of a tensor-parallel group of
    ``tensor_parallel_size`` (heads, FFN width and vocabulary split where they divide: `sharding.target_axes`).

    >>> target_bytes(LlamaConfig.tiny(), jnp.float32), target_bytes(LlamaConfig.tiny(), jnp.float32, 2)
    (82560, 41600)
    """
    shapes = jax.eval_shape(lambda: init_random_weights(cfg, jax.random.key(0), dtype))
    return _split_nbytes(shapes, sharding.target_axes(shapes), int(tensor_parallel_size), sharding.target_units(cfg))


def drafter_param_bytes(cfg: dr.DrafterConfig, dtype: Any = jnp.bfloat16, tensor_parallel_size: int = 1) -> int:
    """Bytes of a drafter's own parameters and buffers, floating ones in ``dtype`` (the embedding and LM head
    it shares with the target are not its own unless ``cfg.own_embeddings``), per device of a tensor-parallel
    group of ``tensor_parallel_size`` (`sharding.drafter_state_axes`).

    >>> drafter_param_bytes(dr.DrafterConfig(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, head_dim=8,
    ...                                      ffn_dim=64, rank=8, block=4), jnp.float32) > 0
    True
    """
    state = nnx.state(nnx.eval_shape(lambda: dr.Drafter(cfg, rngs=nnx.Rngs(0))))
    units = {"heads": int(cfg.n_heads), "kv_heads": int(cfg.n_kv_heads)}
    return _split_nbytes(state, sharding.drafter_state_axes(state), int(tensor_parallel_size), units, dtype)


def kv_bytes_per_token(target: LlamaConfig, drafter: dr.DrafterConfig | None = None,
                       dtype: Any = jnp.bfloat16, tensor_parallel_size: int = 1) -> int:
    """Cache bytes one token costs: the target's K and V in every layer, plus the drafter's context K and V in
    every draft layer; per device of a tensor-parallel group of ``tensor_parallel_size`` (each pool's KV heads
    split where they divide by it, `sharding.paged_cache_axes`; the pool is replicated over data groups).

    >>> kv_bytes_per_token(LlamaConfig.tiny(), None, jnp.float32)  # 2 layers x 2 heads x 8 x (K, V) x 4 bytes
    256
    >>> kv_bytes_per_token(LlamaConfig.tiny(), None, jnp.float32, 2), kv_bytes_per_token(LlamaConfig.tiny(), None,
    ...                                                                                 jnp.float32, 4)
    (128, 256)
    """
    size, tensor = jnp.dtype(dtype).itemsize, int(tensor_parallel_size)
    K, E = target.n_kv_heads, target.head_dim
    page = (1, 1, 2 * K, E)  # one position of one layer's pool
    per = target.n_layers * _split(2 * K * E * size, page, sharding.paged_cache_axes(1).pages[0], tensor,
                                   sharding.kv_pool_units(target))
    if drafter is not None:
        Kd, Ed = drafter.n_kv_heads, drafter.head_dim
        per += _split(drafter.n_layers * Kd * Ed * size, (drafter.n_layers, 1, 1, Kd, Ed),
                      sharding.paged_drafter_cache_axes().k, tensor, {}) * 2
    return int(per)


def workspace_bytes(target: LlamaConfig, drafter: dr.DrafterConfig | None, max_num_batched_tokens: int,
                    max_num_seqs: int, dtype: Any = jnp.bfloat16) -> int:
    """An upper estimate of one round's live activations: the float32 logits of every batched token, the
    widest per-token intermediates of a layer (FFN gate and up, q/k/v, residual) and the taps in ``dtype``, and
    the drafter's float32 block distributions and hidden states. Weights and caches are donated and updated in
    place, so they are not counted twice."""
    size = jnp.dtype(dtype).itemsize
    T, D, F, V = max_num_batched_tokens, target.dim, target.ffn_dim, target.vocab_size
    qkv = (target.n_heads + 2 * target.n_kv_heads) * target.head_dim
    per_token = 4 * V + size * (3 * F + qkv + 4 * D + len(target.tap_layers) * D)
    total = T * per_token
    if drafter is not None:
        G, W = drafter.block, drafter.draft_vocab
        total += max_num_seqs * G * (3 * 4 * W + size * (3 * drafter.ffn_dim + 4 * D))
    return int(total)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where a device's memory goes (bytes unless named otherwise); `plan_memory` makes one."""

    device_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    drafter_bytes: int
    workspace_bytes: int
    kv_bytes_per_token: int
    block_size: int
    kv_pool_pages: int
    kv_pool_tokens: int
    kv_pool_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    dtype: str
    tensor_parallel_size: int = 1  # bytes are per device of a tensor-parallel group of this size

    @property
    def full_length_requests(self) -> float:
        """How many requests of ``max_model_len`` tokens the pool holds at once."""
        return self.kv_pool_tokens / self.max_model_len

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["full_length_requests"] = round(self.full_length_requests, 2)
        return d

    def describe(self) -> str:
        """A few lines for people."""
        g = lambda b: f"{b / GIB:.2f} GiB"
        group = ("" if self.tensor_parallel_size == 1 else
                 f"; per device of a tensor-parallel group of {self.tensor_parallel_size}, every data-parallel "
                 f"group holding the whole pool")
        return "\n".join([
            f"device memory {g(self.device_memory_bytes)} x {self.gpu_memory_utilization:g} = "
            f"{g(self.device_memory_bytes * self.gpu_memory_utilization)} for the engine ({self.dtype}){group}",
            f"  target weights {g(self.weights_bytes)}, drafter {g(self.drafter_bytes)}, "
            f"round workspace {g(self.workspace_bytes)}",
            f"  KV pool {g(self.kv_pool_bytes)}: {self.kv_pool_pages} pages x {self.block_size} tokens = "
            f"{self.kv_pool_tokens} tokens at {self.kv_bytes_per_token} bytes/token (drafter's context included)",
            f"  {self.full_length_requests:.1f} requests of max_model_len {self.max_model_len} at once; "
            f"max_num_seqs {self.max_num_seqs}, max_num_batched_tokens {self.max_num_batched_tokens}",
        ])


def plan_memory(target: LlamaConfig, drafter: dr.DrafterConfig | None, *, device_memory_bytes: int,
                gpu_memory_utilization: float = 0.9, block_size: int = 16, max_model_len: int = 8192,
                max_num_seqs: int = 64, max_num_batched_tokens: int = 512, dtype: Any = jnp.bfloat16,
                tensor_parallel_size: int = 1) -> MemoryPlan:
    """Size the paged KV pool for a target (and drafter) on a device, or on each device of a mesh.

    Args:
      target: the target's config; drafter: the drafter's (None: plain decoding).
      device_memory_bytes: the device's memory; gpu_memory_utilization: the share of it the engine may use,
        in (0, 1].
      block_size: tokens per page; max_model_len: the longest request (prompt + answer) in tokens;
      max_num_seqs: requests decoded together; max_num_batched_tokens: tokens of one round (the workspace).
      dtype: weights' and caches' dtype.
      tensor_parallel_size: the mesh's ``tensor`` size N: weights and pages split over N where the rules split
        them, and ``device_memory_bytes`` is one device's. The pool is replicated over ``data``, so the pages
        planned are one tensor-parallel group's whatever the data-parallel size.
    Returns:
      A `MemoryPlan` (bytes per device; ``kv_pool_pages`` and ``kv_pool_tokens`` the pool's).
    Raises:
      ValueError: bad arguments, or a pool that cannot hold one request of ``max_model_len`` tokens.

    >>> p = plan_memory(LlamaConfig.tiny(), None, device_memory_bytes=2**20, max_model_len=64, max_num_seqs=2,
    ...                 max_num_batched_tokens=16, dtype=jnp.float32)
    >>> p.kv_bytes_per_token, p.kv_pool_tokens >= 64
    (256, True)
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: expected a number in (0, 1], got {gpu_memory_utilization}")
    for name, value in (("device_memory_bytes", device_memory_bytes), ("block_size", block_size),
                        ("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("tensor_parallel_size", tensor_parallel_size)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    tp = int(tensor_parallel_size)
    weights = target_bytes(target, dtype, tp)
    own = 0 if drafter is None else drafter_param_bytes(drafter, dtype, tp)
    work = workspace_bytes(target, drafter, max_num_batched_tokens, max_num_seqs, dtype)
    per_token = kv_bytes_per_token(target, drafter, dtype, tp)
    budget = int(device_memory_bytes * gpu_memory_utilization)
    pool = budget - weights - own - work
    pages = max(pool, 0) // (block_size * per_token)
    tokens = pages * block_size
    if tokens < max_model_len:
        raise ValueError(
            f"the KV pool holds {tokens} tokens, less than one request of max_model_len {max_model_len}: "
            f"{budget / GIB:.2f} GiB usable (gpu_memory_utilization {gpu_memory_utilization:g}), weights "
            f"{weights / GIB:.2f} GiB, drafter {own / GIB:.2f} GiB, workspace {work / GIB:.2f} GiB; raise "
            f"gpu_memory_utilization, lower max_model_len or max_num_batched_tokens, or use a larger tensor-parallel "
            f"size (the pool is replicated over data-parallel groups: more of them do not enlarge it)")
    return MemoryPlan(device_memory_bytes=int(device_memory_bytes), gpu_memory_utilization=float(gpu_memory_utilization),
                      weights_bytes=weights, drafter_bytes=own, workspace_bytes=work, kv_bytes_per_token=per_token,
                      block_size=block_size, kv_pool_pages=int(pages), kv_pool_tokens=int(tokens),
                      kv_pool_bytes=int(pages * block_size * per_token), max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      dtype=jnp.dtype(dtype).name, tensor_parallel_size=tp)
