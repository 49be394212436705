"""Ragged paged attention: one entry point chosen by backend, the einsum reference and the XLA path.

Axis legend: T packed query tokens (all sequences), R sequences (block-table rows), H query heads, K KV heads,
Q = H / K query heads per KV head, E head dim, P pages in the pool, ps page size, M max queries per sequence,
W window (cache positions gathered per sequence, a multiple of ps), N pages per block-table row.

Layout (vLLM v1 / tpu-inference, the layout of the TPU kernel jax ships): one page pool per layer
``kv_pages [P, ps, 2K, E]`` with keys and values interleaved on the combined head axis (index ``2k`` is the key
of KV head ``k``, ``2k + 1`` its value); per round a small metadata set shared by every layer: ``kv_lens [R]``
(cached tokens of each sequence, its new query tokens included: their K/V are written before attention),
``page_indices [R, N]`` (block table), ``cu_q_lens [R + 1]`` (sequence ``i`` owns query rows
``cu_q_lens[i]:cu_q_lens[i + 1]``) and ``num_seqs [1]``. Query ``j`` of sequence ``i`` sits at cache position
``kv_lens[i] - q_len_i + j`` and sees positions up to and including its own (causal). Sequences
``>= num_seqs`` are padding; their rows, like every row past ``cu_q_lens[num_seqs]``, come out as zeros.

Precision: products take the cache's dtype as operands with ``preferred_element_type=float32``; softmax and
accumulation are float32; the pages are never converted to float32 (a bf16 pool stays a bf16 operand).

On a device mesh (the one `jax.set_mesh` made current), XLA cannot partition a Pallas kernel by itself (TPU:
an error; GPU: its operands, the whole pool included, gathered onto every device), so with ``head_axis`` the
kernels run per device under `jax.shard_map`: each device attends with its own KV heads (and their query heads)
over its own share of the pool, split over ``head_axis`` where the KV heads divide by it (else every device
holds every head), every other mesh axis replicated, as the engine lays the pool out
(`sharding.paged_cache_axes`). No communication: a device's heads need nothing of another's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "ragged_paged_attention_xla",
           "per_device", "check_inputs", "write_kv", "slot_mapping", "IMPLS"]

IMPLS = ("auto", "reference", "xla", "tpu", "gpu")

# Large finite negative for masked scores (finite, so a fully masked row never computes inf - inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def check_inputs(fn: str, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> tuple[int, int, int]:
    """Static shape and dtype checks of the ragged paged attention inputs (free under jit: they read shapes).

    Args:
      fn: the calling function's name, for the message.
      q: [T, H, E]; kv_pages: [P, ps, 2K, E] of q's dtype; kv_lens: int32 [R]; page_indices: int32 [R, N];
        cu_q_lens: int32 [R + 1]; num_seqs: int32 [1].

    Returns:
      (K, Q, E).

    Raises:
      ValueError: naming the argument, the expected shape or dtype and what was received.

    >>> q, kv = jnp.zeros((3, 4, 8)), jnp.zeros((6, 4, 4, 8))
    >>> meta = jnp.zeros(2, jnp.int32), jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32), jnp.ones(1, jnp.int32)
    >>> check_inputs("f", q, kv, *meta)
    (2, 2, 8)
    """
    if q.ndim != 3:
        raise ValueError(f"{fn}: q: expected [T, H, E], got shape {tuple(q.shape)}")
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or kv_pages.shape[3] != q.shape[2]:
        raise ValueError(f"{fn}: kv_pages: expected [P, ps, 2K, E] with E = {q.shape[2]} (from q), got shape "
                         f"{tuple(kv_pages.shape)}")
    num_kv_heads = kv_pages.shape[2] // 2
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"{fn}: q: H = {q.shape[1]} query heads is not a multiple of K = {num_kv_heads} KV heads")
    if q.dtype != kv_pages.dtype:
        raise ValueError(f"{fn}: q and kv_pages must share a dtype (products take the cache dtype as operands), "
                         f"got {q.dtype} and {kv_pages.dtype}")
    if page_indices.ndim != 2:
        raise ValueError(f"{fn}: page_indices: expected int32 [R, N], got shape {tuple(page_indices.shape)}")
    r = page_indices.shape[0]
    for name, x, shape in (("kv_lens", kv_lens, (r,)), ("page_indices", page_indices, page_indices.shape),
                           ("cu_q_lens", cu_q_lens, (r + 1,)), ("num_seqs", num_seqs, (1,))):
        if tuple(x.shape) != shape or x.dtype != jnp.int32:
            raise ValueError(f"{fn}: {name}: expected int32 {list(shape)} (R = {r} from page_indices), got "
                             f"{x.dtype} {list(x.shape)}")
    return num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2]


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float | None = None,
                           max_q_per_seq: int | None = None, window: int | None = None, impl: str = "auto",
                           interpret: bool = False, head_axis: str | None = None) -> jax.Array:
    """Causal attention of packed ragged queries over a paged KV cache, by the implementation for the backend.

    Args:
      q: [T, H, E] query tokens of all sequences, packed.
      kv_pages: [P, ps, 2K, E] the layer's page pool, keys and values interleaved on axis 2.
      kv_lens: int32 [R] cached tokens per sequence, its new query tokens included.
      page_indices: int32 [R, N] block table.
      cu_q_lens: int32 [R + 1] query row offsets.
      num_seqs: int32 [1] live sequences; the rest are padding.
      sm_scale: score scale, ``E ** -0.5`` by default.
      max_q_per_seq: static M >= every live q_len (decode 1, verification G + 1): the "xla" path places the
        queries on an [R, M] grid, the "gpu" kernel sizes its query blocks by it; None: any q_len.
      window: static W, a multiple of ps, >= every live kv_len: the "xla" path gathers only the first W / ps
        pages of each block-table row. None: all N pages. The kernels read each sequence's own pages anyway.
      impl: "auto" (TPU: "tpu", GPU: "gpu", CPU: "xla"), "reference", "xla", "tpu" or "gpu".
      interpret: run the Pallas kernel ("tpu", "gpu") in interpret mode.
      head_axis: the mesh axis the heads of ``q`` and ``kv_pages`` split over on the current mesh
        (`jax.set_mesh`; e.g. "tensor"): the kernel ("tpu", "gpu") then runs per device under `jax.shard_map`
        (see the module doc). None, or no mesh of more than one device: called as it is.

    Returns:
      [T, H, E] in q's dtype; padding rows are zeros.

    >>> q, kv = jnp.ones((3, 2, 4)), jnp.ones((4, 2, 2, 4))  # T=3, H=2; P=4, ps=2, K=1, E=4
    >>> out = ragged_paged_attention(q, kv, jnp.array([3, 0], jnp.int32), jnp.array([[2, 0], [0, 0]], jnp.int32),
    ...                              jnp.array([0, 2, 2], jnp.int32), jnp.array([1], jnp.int32), impl="xla")
    >>> out[:, 0, 0].tolist()  # two queries of sequence 0 over ones; the third row is padding
    [1.0, 1.0, 0.0]
    """
    check_inputs("ragged_paged_attention", q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl not in IMPLS:
        raise ValueError(f"ragged_paged_attention: impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), "xla")
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, sm_scale=sm_scale)
    if impl == "xla":
        return ragged_paged_attention_xla(*args, sm_scale=sm_scale, max_q_per_seq=max_q_per_seq, window=window)
    # The kernels import check_inputs from here: imported at call time to keep the import graph one-way.
    if impl == "tpu":
        from dspark_jax.kernels.tpu import ragged_paged_attention_tpu

        kernel = functools.partial(ragged_paged_attention_tpu, sm_scale=sm_scale, interpret=interpret)
    else:
        from dspark_jax.kernels.gpu import ragged_paged_attention_gpu

        kernel = functools.partial(ragged_paged_attention_gpu, sm_scale=sm_scale, max_q_per_seq=max_q_per_seq,
                                   interpret=interpret)
    return per_device(kernel, head_axis)(*args)


def per_device(kernel, head_axis: str | None):
    """``kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)`` run per device of the current mesh
    (`jax.set_mesh`) under `jax.shard_map`: ``q`` [T, H, E] and ``kv_pages`` [P, ps, 2K, E] split over
    ``head_axis`` on their head axes where the K KV heads divide by its size (a device's query heads are then
    those of its KV heads), else whole on every device; the metadata whole; every other mesh axis replicated.
    The kernel itself where there is no such mesh (none current, one device, or ``head_axis`` None).

    >>> per_device(len, None) is len
    True
    """
    mesh = jax.sharding.get_abstract_mesh()
    if head_axis is None or mesh.empty or mesh.size == 1:
        return kernel

    def run(q, kv_pages, *meta):
        n = dict(mesh.shape).get(head_axis, 1)
        heads = head_axis if n > 1 and (kv_pages.shape[2] // 2) % n == 0 else None
        return jax.shard_map(kernel, mesh=mesh, in_specs=(P(None, heads, None), P(None, None, heads, None),
                                                          *(P() for _ in meta)),
                             out_specs=P(None, heads, None), check_vma=False)(q, kv_pages, *meta)

    return run


def ragged_paged_attention_reference(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array,
                                     page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                                     sm_scale: float | None = None) -> jax.Array:
    """The test oracle: one plain einsum attention per sequence in a Python loop (eager only, it reads the
    metadata on the host; slow). Arguments and result as `ragged_paged_attention`.

    >>> q, kv = jnp.ones((2, 1, 4)), jnp.ones((2, 2, 2, 4))
    >>> ragged_paged_attention_reference(q, kv, jnp.array([2], jnp.int32), jnp.array([[1]], jnp.int32),
    ...                                  jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32))[:, 0, 0].tolist()
    [1.0, 0.0]
    """
    num_kv_heads, group, head_dim = check_inputs("ragged_paged_attention_reference", q, kv_pages, kv_lens,
                                                 page_indices, cu_q_lens, num_seqs)
    if any(isinstance(x, jax.core.Tracer) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)):
        raise ValueError("ragged_paged_attention_reference: eager only (it reads the metadata on the host); "
                         "use impl='xla' under jit")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    kv_lens, page_indices, cu_q_lens = np.asarray(kv_lens), np.asarray(page_indices), np.asarray(cu_q_lens)
    page_size = kv_pages.shape[1]
    out = jnp.zeros_like(q)
    for i in range(int(np.asarray(num_seqs)[0])):
        start, stop, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        if stop == start:
            continue
        pages = page_indices[i, : -(-kv_len // page_size)]
        kv = kv_pages[pages].reshape(-1, num_kv_heads, 2, head_dim)[:kv_len]  # [S, K, 2, E]
        qi = q[start:stop].reshape(stop - start, num_kv_heads, group, head_dim)  # [t, K, Q, E]
        s = jnp.einsum("tkqe,ske->kqts", qi, kv[:, :, 0], preferred_element_type=jnp.float32) * scale
        q_pos = kv_len - (stop - start) + np.arange(stop - start)
        visible = np.arange(kv_len)[None, :] <= q_pos[:, None]  # [t, S]
        s = jnp.where(visible, s, MASK_VALUE)
        p = jnp.where(visible, jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
        p = p / jnp.maximum(p.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
        o = jnp.einsum("kqts,ske->tkqe", p.astype(kv.dtype), kv[:, :, 1], preferred_element_type=jnp.float32)
        out = out.at[start:stop].set(o.reshape(stop - start, -1, head_dim).astype(q.dtype))
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_q_per_seq", "window"))
def ragged_paged_attention_xla(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                               cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float | None = None,
                               max_q_per_seq: int | None = None, window: int | None = None) -> jax.Array:
    """The CPU path: pages gathered once per sequence, two batched matmuls with the batch axes leading.

    With ``max_q_per_seq`` = M the queries of each sequence sit on an [R, M] grid and the cost follows
    R * M * W; without it every token is its own row of the grid (M = 1, R = T: cost T * W, and the pages are
    gathered once per token). Arguments and result as `ragged_paged_attention`; contract: every live
    q_len <= M, every live kv_len <= W, and the pool holds finite values past each kv_len (a zero-initialised
    pool written only by `write_kv` does: those entries get weight exactly 0).

    >>> q, kv = jnp.ones((2, 1, 4)), jnp.ones((2, 2, 2, 4))
    >>> ragged_paged_attention_xla(q, kv, jnp.array([2], jnp.int32), jnp.array([[1]], jnp.int32),
    ...                            jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32), max_q_per_seq=1,
    ...                            window=2)[:, 0, 0].tolist()
    [1.0, 0.0]
    """
    _, group, head_dim = check_inputs("ragged_paged_attention_xla", q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                      num_seqs)
    num_tokens = q.shape[0]
    num_rows, pages_per_row = page_indices.shape
    page_size = kv_pages.shape[1]
    window = pages_per_row * page_size if window is None else window
    if window % page_size or not 0 < window <= pages_per_row * page_size:
        raise ValueError(f"ragged_paged_attention_xla: window: expected a positive multiple of page_size = "
                         f"{page_size} up to {pages_per_row * page_size} (the block table's span), got {window}")
    if max_q_per_seq is not None and max_q_per_seq < 1:
        raise ValueError(f"ragged_paged_attention_xla: max_q_per_seq: expected >= 1 or None, got {max_q_per_seq}")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale

    # Each token's sequence and index within it, counting only live sequences (padding entries of cu_q_lens
    # may hold anything).
    live = jnp.arange(num_rows) < num_seqs[0]  # [R]
    t = jnp.arange(num_tokens)  # [T]
    seq = jnp.sum(live[None, :] & (cu_q_lens[None, 1:] <= t[:, None]), axis=1)  # [T]
    seq = jnp.minimum(seq, num_rows - 1)
    q_len = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [R]
    within = t - cu_q_lens[seq]  # [T]
    valid = t < cu_q_lens[num_seqs[0]]  # [T]
    pages = page_indices[:, : window // page_size]  # [R, W / ps]
    if max_q_per_seq is None:  # per-token form: row t holds token t alone, at position kv_len - q_len + within
        kv_len = jnp.where(valid, kv_lens[seq] - q_len[seq] + within + 1, 0)
        out = _attend_grid(q[:, None], kv_pages, pages[seq], kv_len, jnp.ones_like(kv_len), scale=scale)
        return jnp.where(valid[:, None, None], out[:, 0], 0).astype(q.dtype)
    # [R, M, H, E]: query j of sequence i, rows past q_len clamped (their outputs are never read)
    rows = jnp.minimum(cu_q_lens[:-1, None] + jnp.arange(max_q_per_seq)[None, :], num_tokens - 1)
    out = _attend_grid(q[rows], kv_pages, pages, jnp.where(live, kv_lens, 0), q_len, scale=scale)
    out = out.reshape(num_rows * max_q_per_seq, *q.shape[1:])[seq * max_q_per_seq + jnp.minimum(within,
                                                                                               max_q_per_seq - 1)]
    return jnp.where((valid & (within < max_q_per_seq))[:, None, None], out, 0).astype(q.dtype)


def _attend_grid(q_grid, kv_pages, pages, kv_len, q_len, *, scale):
    """Attention of an [R, M] query grid over each row's pages; query m of row r at kv_len - q_len + m.

    q_grid: [R, M, H, E]; pages: [R, W / ps] page ids; kv_len, q_len: [R]. Returns float32 [R, M, H, E];
    a row that sees nothing (kv_len 0) gives zeros.
    """
    num_rows, max_q, num_heads, head_dim = q_grid.shape
    num_kv_heads = kv_pages.shape[2] // 2
    group = num_heads // num_kv_heads
    window = pages.shape[1] * kv_pages.shape[1]
    # [R, W, K, 2, E] -> [R, K, 2, W, E]: one gather and one copy, so that both matmuls have (R, K) leading.
    kv = kv_pages.at[pages].get(mode="clip").reshape(num_rows, window, num_kv_heads, 2, head_dim)
    kv = kv.transpose(0, 2, 3, 1, 4)
    # [R, K, M * Q, E]: the Q heads of a KV head and the M queries flattened into one row axis (m major).
    qg = q_grid.reshape(num_rows, max_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(num_rows, num_kv_heads, max_q * group, head_dim)
    s = jnp.einsum("rkie,rkwe->rkiw", qg, kv[:, :, 0], preferred_element_type=jnp.float32) * scale
    q_pos = (kv_len - q_len)[:, None] + jnp.arange(max_q * group)[None, :] // group  # [R, M * Q]
    w = jnp.arange(window)
    visible = (w[None, None, :] <= q_pos[:, :, None]) & (w[None, None, :] < kv_len[:, None, None])
    visible = visible[:, None]  # [R, 1, M * Q, W]
    s = jnp.where(visible, s, MASK_VALUE)
    p = jnp.where(visible, jnp.exp(s - s.max(-1, keepdims=True)), 0.0)  # unnormalised, max 1
    denom = jnp.maximum(p.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)  # [R, K, M * Q, 1]
    o = jnp.einsum("rkiw,rkwe->rkie", p.astype(kv.dtype), kv[:, :, 1], preferred_element_type=jnp.float32) / denom
    o = o.reshape(num_rows, num_kv_heads, max_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    return o.reshape(num_rows, max_q, num_heads, head_dim)


@jax.jit
def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Writes new keys and values into the page pool at flat slots; a slot < 0 or >= P * ps writes nothing.

    Args:
      kv_pages: [P, ps, 2K, E] the page pool (donate it at the caller's jit to update in place).
      k, v: [T, K, E] new keys and values (cast to the pool's dtype).
      slot_mapping: int32 [T] flat slot ``page * ps + offset`` of each token; padding tokens pass -1.

    Returns:
      [P, ps, 2K, E] the pool with k at combined head 2k and v at 2k + 1 of each written slot. Two tokens
      with the same valid slot leave one of them there, unspecified which.

    >>> pool = write_kv(jnp.zeros((2, 2, 2, 1)), jnp.ones((2, 1, 1)), 2 * jnp.ones((2, 1, 1)),
    ...                 jnp.array([3, -1], jnp.int32))
    >>> pool[1, 1, :, 0].tolist(), float(pool.sum())
    ([1.0, 2.0], 3.0)
    """
    num_pages, page_size, combined, head_dim = kv_pages.shape
    num_slots = num_pages * page_size
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim).astype(kv_pages.dtype)  # [T, 2K, E]
    # Out-of-range slots to num_slots, which mode="drop" skips (a negative index would wrap around).
    slots = jnp.where((slot_mapping >= 0) & (slot_mapping < num_slots), slot_mapping, num_slots)
    flat = kv_pages.reshape(num_slots, combined, head_dim).at[slots].set(kv, mode="drop")
    return flat.reshape(kv_pages.shape)


@functools.partial(jax.jit, static_argnames=("page_size",))
def slot_mapping(page_indices: jax.Array, seq_ids: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat pool slots of tokens from the block table.

    Args:
      page_indices: int32 [R, N] block table.
      seq_ids: int [T] block-table row of each token; < 0 for padding tokens.
      positions: int [T] cache position of each token; < 0 for padding tokens.
      page_size: ps.

    Returns:
      int32 [T] ``page_indices[seq, pos // ps] * ps + pos % ps``; -1 for padding tokens and positions past the
      block table (write nothing through `write_kv`).

    >>> slot_mapping(jnp.array([[5, 2]], jnp.int32), jnp.array([0, 0, -1]), jnp.array([1, 4, 0]), 4).tolist()
    [21, 8, -1]
    """
    num_rows, pages_per_row = page_indices.shape
    page = positions // page_size
    ok = (seq_ids >= 0) & (seq_ids < num_rows) & (positions >= 0) & (page < pages_per_row)
    ids = page_indices[jnp.clip(seq_ids, 0, num_rows - 1), jnp.clip(page, 0, pages_per_row - 1)]
    return jnp.where(ok, ids * page_size + positions % page_size, -1).astype(jnp.int32)
