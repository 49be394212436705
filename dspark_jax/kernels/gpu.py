"""GPU: a Pallas (Triton lowering) ragged paged attention kernel with an online softmax over pages.

Axis legend: T packed query tokens, R sequences, H query heads, K KV heads, Q = H / K, E head dim, P pages,
ps page size, N pages per block-table row, M max queries per sequence; kernel blocks: BT query tokens per
program, Qp = Q, Ep = E and Sp = ps each rounded up to a power of two, BR = BT * Qp score rows.

Grid (R, K, cdiv(M, BT)): program (i, k, b) takes query tokens ``b * BT .. b * BT + BT - 1`` of sequence i with
the Q query heads of KV head k, folded into one [BR, Ep] operand (row = token * Qp + head), so each page of K
and V is loaded once for all Q heads. It loops (``lax.fori_loop``) over the sequence's pages up to the last one
its queries see, a dynamic trip count: a program's cost follows its own sequence's length, and a program
whose block holds no query (padding sequence, short sequence, q_len 0) runs no iteration and writes nothing.

Block sizes (Triton wants power-of-two block dims and dot operands of at least 16 per dim): Qp, Ep and
Sp = max(16, ps) are padded with masked loads (a page of 8 tokens is read as 16 with the tail masked, so any
ps works, at a cost when ps < 16); BT is M rounded up to a power of two, at least 16 / Qp (BR >= 16) and at
most 128 / Qp (BR <= 128 keeps the score tile in registers), so decode (M = 1) and verification (M = G + 1)
run one query block per (sequence, KV head). Without M, BT = 64 / Qp and the grid covers T tokens per
sequence (mostly empty programs, which exit at once).

Rows no program writes (padding) are zeros: the output starts as zeros and is aliased to the kernel's output.
Scores and the softmax are float32 (``preferred_element_type``), K and V stay in the pool's dtype, the
probabilities are cast to it for the second product (as flash attention does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dspark_jax.kernels.attention import MASK_VALUE, check_inputs

__all__ = ["ragged_paged_attention_gpu", "block_sizes"]

MIN_DOT = 16  # Triton's smallest dot operand dim
MAX_ROWS = 128  # score rows per program (BR)
DEFAULT_ROWS = 64  # BR when max_q_per_seq is None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_sizes(group: int, head_dim: int, page_size: int, max_q_per_seq: int | None) -> dict[str, int]:
    """The kernel's static block sizes (see the module docstring).

    Args:
      group: Q query heads per KV head; head_dim: E; page_size: ps; max_q_per_seq: M or None.

    Returns:
      {"BT": query tokens per program, "Qp", "Ep", "Sp": padded heads, head dim and page, "BR": BT * Qp}.

    >>> block_sizes(3, 64, 16, 1)
    {'BT': 4, 'Qp': 4, 'Ep': 64, 'Sp': 16, 'BR': 16}
    >>> block_sizes(1, 64, 16, 5)["BT"], block_sizes(1, 64, 16, None)["BT"]
    (16, 64)
    """
    qp = _pow2(group)
    low, high = max(1, MIN_DOT // qp), max(1, MAX_ROWS // qp)
    bt = max(1, DEFAULT_ROWS // qp) if max_q_per_seq is None else _pow2(max_q_per_seq)
    bt = min(max(bt, low), high)
    return {"BT": bt, "Qp": qp, "Ep": max(MIN_DOT, _pow2(head_dim)), "Sp": max(MIN_DOT, _pow2(page_size)),
            "BR": bt * qp}


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_q_per_seq", "interpret", "num_warps"))
def ragged_paged_attention_gpu(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                               cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float | None = None,
                               max_q_per_seq: int | None = None, interpret: bool = False,
                               num_warps: int = 4) -> jax.Array:
    """Ragged paged attention by this module's Pallas kernel. Arguments and result as
    `dspark_jax.kernels.ragged_paged_attention`.

    Args:
      max_q_per_seq: static M >= every live q_len; sizes the query blocks (None: up to T per sequence).
      interpret: run in Pallas interpret mode (any backend, CPU included).
      num_warps: Triton warps per program.

    Returns:
      [T, H, E] in q's dtype; padding rows are zeros.

    >>> q, kv = jnp.ones((2, 1, 4)), jnp.ones((2, 2, 2, 4))
    >>> ragged_paged_attention_gpu(q, kv, jnp.array([2], jnp.int32), jnp.array([[1]], jnp.int32),
    ...                            jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32), max_q_per_seq=1,
    ...                            interpret=True)[:, 0, 0].tolist()
    [1.0, 0.0]
    """
    num_kv_heads, group, head_dim = check_inputs("ragged_paged_attention_gpu", q, kv_pages, kv_lens, page_indices,
                                                 cu_q_lens, num_seqs)
    if max_q_per_seq is not None and max_q_per_seq < 1:
        raise ValueError(f"ragged_paged_attention_gpu: max_q_per_seq: expected >= 1 or None, got {max_q_per_seq}")
    num_tokens = q.shape[0]
    num_rows = page_indices.shape[0]
    page_size = kv_pages.shape[1]
    blocks = block_sizes(group, head_dim, page_size, max_q_per_seq)
    num_q_blocks = pl.cdiv(num_tokens if max_q_per_seq is None else max_q_per_seq, blocks["BT"])
    kernel = functools.partial(_kernel, group=group, head_dim=head_dim, page_size=page_size,
                               scale=head_dim**-0.5 if sm_scale is None else sm_scale, **blocks)
    return pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads, num_q_blocks),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        input_output_aliases={6: 0},  # the zeros below: rows no program writes stay zero
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_pages, jnp.zeros_like(q))


def _kernel(kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, q_ref, kv_ref, _zeros_ref, o_ref, *,
            group, head_dim, page_size, scale, BT, Qp, Ep, Sp, BR):
    """One (sequence i, KV head k, query block b). All refs are whole arrays (no BlockSpecs: rows are ragged)."""
    i, k, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    live = i < num_seqs_ref[0]
    q_start = cu_q_lens_ref[i]
    q_len = jnp.where(live, cu_q_lens_ref[i + 1] - q_start, 0)
    kv_len = jnp.where(live, kv_lens_ref[i], 0)
    first = b * BT  # first query (within the sequence) of this block
    n_q = jnp.clip(q_len - first, 0, BT)  # queries this block holds
    context = kv_len - q_len  # cache position of the sequence's query 0
    # Keys up to the block's last query: the pages the loop visits (none for an empty block).
    n_keys = jnp.where(n_q > 0, jnp.minimum(kv_len, context + first + n_q), 0)
    n_pages = jnp.minimum((n_keys + page_size - 1) // page_size, page_indices_ref.shape[1])

    # [BT, Qp, Ep] this block's queries and heads; padded tokens, heads and dims masked (read as 0, not stored).
    tok = jnp.arange(BT)[:, None, None]
    qmask = (tok < n_q) & (jnp.arange(Qp)[None, :, None] < group) & (jnp.arange(Ep)[None, None, :] < head_dim)
    q_at = (pl.ds(q_start + first, BT), pl.ds(k * group, Qp), pl.ds(0, Ep))
    qf = plgpu.load(q_ref.at[q_at], mask=qmask, other=0).reshape(BR, Ep)  # row = token * Qp + head
    row_pos = context + first + jnp.arange(BR) // Qp  # [BR] cache position of each row's query
    offset = jnp.arange(Sp)  # [Sp] position within a page
    e_ok = jnp.arange(Ep)[None, :] < head_dim
    # Full f32 products for f32 inputs (Triton's default is TF32); bf16 inputs use the bf16 MMA.
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def body(p, carry):
        acc, m, l = carry  # [BR, Ep], [BR], [BR] float32
        page = page_indices_ref[i, p]
        pos = p * page_size + offset  # [Sp]
        in_page = (offset < page_size) & (pos < kv_len)
        kv_mask = in_page[:, None] & e_ok  # [Sp, Ep]: masked entries read as 0, so stale values never enter
        key = plgpu.load(kv_ref.at[page, pl.ds(0, Sp), 2 * k, pl.ds(0, Ep)], mask=kv_mask, other=0)
        value = plgpu.load(kv_ref.at[page, pl.ds(0, Sp), 2 * k + 1, pl.ds(0, Ep)], mask=kv_mask, other=0)
        s = lax.dot_general(qf, key, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [BR, Sp]
        visible = in_page[None, :] & (pos[None, :] <= row_pos[:, None])
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        prob = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        pv = lax.dot_general(prob.astype(value.dtype), value, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)  # [BR, Ep]
        return acc * alpha[:, None] + pv, m_new, l * alpha + prob.sum(axis=1)

    init = (jnp.zeros((BR, Ep), jnp.float32), jnp.full((BR,), MASK_VALUE, jnp.float32), jnp.zeros((BR,), jnp.float32))
    acc, _, l = lax.fori_loop(0, n_pages, body, init)
    out = acc / jnp.where(l == 0, 1.0, l)[:, None]  # a row that saw nothing gives zeros
    plgpu.store(o_ref.at[q_at], out.reshape(BT, Qp, Ep).astype(o_ref.dtype), mask=qmask)
