"""TPU: a thin wrapper over the ragged paged attention kernel jax ships.

Axis legend: T packed query tokens, R sequences, H query heads, K KV heads, Q = H / K, E head dim, P pages,
ps page size, N pages per block-table row.

The shipped kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) takes exactly this package's
layout (``kv_pages [P, ps, 2K, E]``, keys at combined head 2k, values at 2k + 1) and metadata; the wrapper adds
what it leaves to the caller: the default score scale, block sizes off TPU (its tuned table reads the TPU
version), interpret mode, and zeros on padding rows (the kernel leaves query rows past
``cu_q_lens[num_seqs]`` as whatever its scratch held).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

from dspark_jax.kernels.attention import check_inputs

__all__ = ["ragged_paged_attention_tpu"]

# Block sizes when the tuned table cannot be read (off TPU: interpret mode, abstract evaluation). The kernel's
# own fallback for TPU v4 is (32 pages, 32 queries); these are smaller so that interpret runs stay small.
DEFAULT_KV_PAGES_PER_BLOCK = 8
DEFAULT_QUERIES_PER_BLOCK = 16


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_kv_pages_per_block", "num_queries_per_block",
                                             "vmem_limit_bytes", "interpret"))
def ragged_paged_attention_tpu(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                               cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float | None = None,
                               num_kv_pages_per_block: int | None = None, num_queries_per_block: int | None = None,
                               vmem_limit_bytes: int | None = None, interpret: bool = False) -> jax.Array:
    """Ragged paged attention by the TPU kernel jax ships. Arguments and result as
    `dspark_jax.kernels.ragged_paged_attention`, plus the kernel's tuning knobs.

    Args:
      num_kv_pages_per_block, num_queries_per_block: the kernel's block sizes; None: its tuned table on TPU,
        (8, 16) clipped to (N, T) elsewhere.
      vmem_limit_bytes: the kernel's VMEM limit (None: the compiler's default).
      interpret: trace the kernel under ``pltpu.force_tpu_interpret_mode`` (the TPU interpreter on CPU). In
        jax 0.10.2 the interpreter cannot run this kernel (it reshapes a DMA'd ref, which the interpreter does
        not support), so on CPU only abstract evaluation (``jax.eval_shape``) works.

    Returns:
      [T, H, E] in q's dtype; rows past ``cu_q_lens[num_seqs]`` are zeros.

    >>> S = jax.ShapeDtypeStruct
    >>> out = jax.eval_shape(ragged_paged_attention_tpu, S((8, 4, 128), jnp.bfloat16),
    ...     S((16, 16, 4, 128), jnp.bfloat16), S((3,), jnp.int32), S((3, 4), jnp.int32), S((4,), jnp.int32),
    ...     S((1,), jnp.int32))
    >>> out.shape, out.dtype
    ((8, 4, 128), dtype(bfloat16))
    """
    check_inputs("ragged_paged_attention_tpu", q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    scale = q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale)
    if jax.default_backend() != "tpu" or interpret:
        num_kv_pages_per_block = num_kv_pages_per_block or min(DEFAULT_KV_PAGES_PER_BLOCK, page_indices.shape[1])
        num_queries_per_block = num_queries_per_block or min(DEFAULT_QUERIES_PER_BLOCK, q.shape[0])
    mode = pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if interpret else contextlib.nullcontext()
    with mode:
        out = rpa.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=scale,
                                         num_kv_pages_per_block=num_kv_pages_per_block,
                                         num_queries_per_block=num_queries_per_block,
                                         vmem_limit_bytes=vmem_limit_bytes)
    valid = jnp.arange(q.shape[0]) < cu_q_lens[num_seqs[0]]  # [T]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
