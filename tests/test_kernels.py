"""Ragged paged attention (dspark_jax.kernels): every implementation against the einsum reference, the reference
against jax's own and a dense NumPy attention, the page writes, and the bf16 precision rule of the XLA path.

Tolerances: float32 inputs rtol = atol = 1e-5 (the paths differ only in summation order); bf16 pages and
queries atol = rtol = 2e-2 against the reference run on the same values in float32 (bf16 operands, float32
accumulation, and the probabilities rounded to bf16 for the second product).
"""

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa

from dspark_jax.kernels import (
    check_inputs,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
    slot_mapping,
    write_kv,
)
from tests.helpers import count_compilations

F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: live sequences' query and cache lengths, then padding rows up to num_rows."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    group: int  # Q
    num_rows: int = 6  # R (live + padding)
    num_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 4
    pages_per_row: int = 12
    extra_tokens: int = 3  # padding query rows past cu_q_lens[num_seqs]
    garbage_cu: bool = False  # padding entries of cu_q_lens hold 0 instead of the last offset

    @property
    def max_q(self):
        return max(self.q_lens)


def make_inputs(case: Case, seed=0, dtype=jnp.float32):
    """Random q and pool, a shuffled block table over the whole pool (non-contiguous pages), padding rows whose
    metadata and queries hold non-zero garbage."""
    rng = np.random.default_rng(seed)
    n, r, k, e, ps = len(case.q_lens), case.num_rows, case.num_kv_heads, case.head_dim, case.page_size
    num_pages = r * case.pages_per_row + 5
    num_tokens = sum(case.q_lens) + case.extra_tokens
    q = rng.standard_normal((num_tokens, k * case.group, e)).astype(np.float32)
    kv = rng.standard_normal((num_pages, ps, 2 * k, e)).astype(np.float32)
    page_indices = rng.permutation(num_pages)[: r * case.pages_per_row].reshape(r, -1).astype(np.int32)
    kv_lens = rng.integers(1, case.pages_per_row * ps, r).astype(np.int32)
    kv_lens[:n] = case.kv_lens
    cu = np.zeros(r + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(case.q_lens)
    cu[n + 1 :] = 0 if case.garbage_cu else cu[n]
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(kv_lens), jnp.asarray(page_indices),
            jnp.asarray(cu), jnp.array([n], jnp.int32))


def reference(args):
    """The reference on float32 copies of the inputs (the oracle for bf16 runs too)."""
    q, kv, *meta = args
    return np.asarray(ragged_paged_attention_reference(q.astype(jnp.float32), kv.astype(jnp.float32), *meta))


def check(out, args, dtype=jnp.float32):
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, reference(args), **(F32_TOL if dtype == jnp.float32 else BF16_TOL))
    live_rows = int(args[4][int(args[5][0])])
    assert (out[live_rows:] == 0).all()  # padding query rows: exact zeros


# ps = 4: kv_len 4, 8, 16 end exactly on a page, 1 is a single token, q_len 0 a sequence with no query.
DECODE = Case(q_lens=(1, 1, 1, 1), kv_lens=(1, 4, 9, 16), group=3)  # M = 1, 2 padding rows
VERIFY = Case(q_lens=(5, 1, 0, 3), kv_lens=(5, 8, 7, 12), group=4)  # M = G + 1 = 5
PREFILL = Case(q_lens=(8, 2, 7), kv_lens=(8, 33, 40), group=1, num_rows=4, garbage_cu=True)
CASES = {"decode": DECODE, "verify": VERIFY, "prefill": PREFILL}


def test_reference_matches_jax_reference():
    """Same layout as the TPU kernel: the reference agrees with jax's ref_ragged_paged_attention on live rows
    (one case: jax's reference runs op by op and is slow)."""
    args = make_inputs(VERIFY)
    live_rows = int(args[4][int(args[5][0])])
    theirs = jax_rpa.ref_ragged_paged_attention(*args, sm_scale=args[0].shape[2] ** -0.5)
    np.testing.assert_allclose(reference(args)[:live_rows], np.asarray(theirs), **F32_TOL)


def test_written_cache_matches_dense_attention():
    """write_kv + slot_mapping + attention over a shuffled block table equals dense causal GQA attention in
    NumPy over the original keys and values: two sequences, the second with a 3-token chunk after 10."""
    rng = np.random.default_rng(1)
    k_heads, group, e, ps, lens = 2, 3, 8, 4, (6, 13)
    keys = [rng.standard_normal((n, k_heads, e)).astype(np.float32) for n in lens]
    values = [rng.standard_normal((n, k_heads, e)).astype(np.float32) for n in lens]
    queries = [rng.standard_normal((n, k_heads * group, e)).astype(np.float32) for n in lens]
    page_indices = jnp.asarray(rng.permutation(10)[:8].reshape(2, 4), jnp.int32)
    seq_ids = np.concatenate([np.full(n, i) for i, n in enumerate(lens)])
    positions = np.concatenate([np.arange(n) for n in lens])
    pool = write_kv(jnp.zeros((10, ps, 2 * k_heads, e)), jnp.asarray(np.concatenate(keys)),
                    jnp.asarray(np.concatenate(values)), slot_mapping(page_indices, seq_ids, positions, ps))
    q = jnp.asarray(np.concatenate([queries[0], queries[1][10:]]))  # all of 0; the last 3 queries of 1
    cu = jnp.array([0, lens[0], lens[0] + 3], jnp.int32)
    out = ragged_paged_attention(q, pool, jnp.array(lens, jnp.int32), page_indices, cu, jnp.array([2], jnp.int32),
                                 max_q_per_seq=6, window=16, impl="xla")

    def dense(qs, ks, vs):  # [S, H, E] causal attention, head h on KV head h // group
        ks, vs = np.repeat(ks, group, axis=1), np.repeat(vs, group, axis=1)
        s = np.einsum("the,she->hts", qs, ks) * e**-0.5
        s = np.where(np.tril(np.ones((len(qs), len(qs)), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("hts,she->the", p / p.sum(-1, keepdims=True), vs)

    want = np.concatenate([dense(*x)[-n:] for x, n in zip(zip(queries, keys, values), (6, 3))])
    np.testing.assert_allclose(np.asarray(out), want, **F32_TOL)


@pytest.mark.parametrize("name", CASES)
def test_xla_matches_reference(name):
    """Eager (its own jit), inside an outer jit through the entry point, with a window, and the per-token
    general form (no M)."""
    case = CASES[name]
    args = make_inputs(case)
    check(ragged_paged_attention_xla(*args, max_q_per_seq=case.max_q), args)
    entry = jax.jit(functools.partial(ragged_paged_attention, impl="xla", max_q_per_seq=case.max_q,
                                      window=case.page_size * -(-max(case.kv_lens) // case.page_size)))
    check(entry(*args), args)
    check(ragged_paged_attention_xla(*args), args)


def test_xla_op_by_op_and_auto():
    """The same numbers op by op (jax.disable_jit), and impl="auto" on CPU is the XLA path."""
    args = make_inputs(VERIFY, seed=2)
    with jax.disable_jit():
        check(ragged_paged_attention_xla(*args, max_q_per_seq=5, window=16), args)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(ragged_paged_attention(*args, max_q_per_seq=5)),
                                      np.asarray(ragged_paged_attention_xla(*args, max_q_per_seq=5)))


@pytest.mark.parametrize("name", CASES)
def test_bf16_pages(name):
    case = CASES[name]
    args = make_inputs(case, seed=3, dtype=jnp.bfloat16)
    out = ragged_paged_attention_xla(*args, max_q_per_seq=case.max_q)
    assert out.dtype == jnp.bfloat16
    check(out, args, jnp.bfloat16)
    check(ragged_paged_attention_gpu(*args, max_q_per_seq=case.max_q, interpret=True), args, jnp.bfloat16)


@pytest.mark.parametrize("name", CASES)
def test_gpu_kernel_interpret_matches_reference(name):
    """The Pallas kernel in interpret mode: with M (one query block per sequence and KV head, or several when
    M exceeds the block) and without."""
    case = CASES[name]
    args = make_inputs(case, seed=4)
    check(ragged_paged_attention_gpu(*args, max_q_per_seq=case.max_q, interpret=True), args)
    if name == "verify":
        check(ragged_paged_attention_gpu(*args, interpret=True), args)


def test_gpu_kernel_never_reads_past_kv_len():
    """Pool entries past each kv_len (and padding rows' pages) hold NaN: the kernel's masked loads never read
    them, so the output is still the reference's. (The XLA path's contract is a finite pool instead.)"""
    case = VERIFY
    q, kv, kv_lens, page_indices, cu, num_seqs = args = make_inputs(case, seed=5)
    stale = np.ones(kv.shape[:2], bool)  # [P, ps]
    for i, kv_len in enumerate(case.kv_lens):
        for pos in range(kv_len):
            stale[page_indices[i, pos // case.page_size], pos % case.page_size] = False
    kv = jnp.where(stale[:, :, None, None], jnp.nan, kv)
    nan_args = (q, kv, kv_lens, page_indices, cu, num_seqs)
    out = ragged_paged_attention(*nan_args, max_q_per_seq=5, impl="gpu", interpret=True)
    check(out, args)


@pytest.mark.parametrize("dtype,max_q", [(jnp.bfloat16, 1), (jnp.float32, 5), (jnp.bfloat16, None)])
def test_gpu_kernel_lowers_to_triton(dtype, max_q):
    """The kernel passes Pallas's Triton lowering (block shapes, ops) for CUDA, lowered from this CPU host:
    odd Q, E and ps are padded to powers of two inside."""
    group, head_dim, page_size = (3, 64, 16) if max_q == 1 else (1, 40, 8) if max_q == 5 else (4, 128, 32)
    s = jax.ShapeDtypeStruct
    args = (s((12, 2 * group, head_dim), dtype), s((32, page_size, 4, head_dim), dtype), s((4,), jnp.int32),
            s((4, 8), jnp.int32), s((5,), jnp.int32), s((1,), jnp.int32))
    lowered = jax.jit(functools.partial(ragged_paged_attention_gpu, max_q_per_seq=max_q)).trace(*args).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text and 'name = "ragged_paged_attention_gpu"' in text


def test_tpu_wrapper_plumbing():
    """The shipped TPU kernel cannot run in the TPU interpreter on CPU (jax 0.10.2), so on CPU only its
    arguments and shapes are checked, by abstract evaluation through the entry point."""
    s = jax.ShapeDtypeStruct
    args = (s((24, 8, 128), jnp.bfloat16), s((40, 16, 4, 128), jnp.bfloat16), s((5,), jnp.int32),
            s((5, 6), jnp.int32), s((6,), jnp.int32), s((1,), jnp.int32))
    out = jax.eval_shape(functools.partial(ragged_paged_attention, impl="tpu"), *args)
    assert (out.shape, out.dtype) == ((24, 8, 128), jnp.bfloat16)
    out = jax.eval_shape(functools.partial(ragged_paged_attention_tpu, sm_scale=0.5, num_kv_pages_per_block=3,
                                           num_queries_per_block=8), *args)
    assert (out.shape, out.dtype) == ((24, 8, 128), jnp.bfloat16)


@pytest.mark.accelerator
@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
def test_tpu_kernel_matches_reference():
    case = dataclasses.replace(VERIFY, head_dim=128, page_size=16, num_kv_heads=2, group=2)
    args = make_inputs(case, seed=6, dtype=jnp.bfloat16)
    check(ragged_paged_attention(*args, impl="tpu"), args, jnp.bfloat16)


@pytest.mark.accelerator
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("name", CASES)
def test_gpu_kernel_compiled_matches_reference(name):
    case = dataclasses.replace(CASES[name], head_dim=64, page_size=16)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = make_inputs(case, seed=7, dtype=dtype)
        check(ragged_paged_attention(*args, max_q_per_seq=case.max_q, impl="gpu"), args, dtype)
        check(ragged_paged_attention(*args, impl="gpu"), args, dtype)


def test_write_kv_slot_mapping_round_trip():
    """Tokens land at their block table's slots (k at combined head 2k, v at 2k + 1); padding tokens (seq -1,
    position -1, past the block table) and raw out-of-range slots (negative or >= P * ps) write nothing."""
    rng = np.random.default_rng(8)
    num_pages, ps, k_heads, e = 9, 4, 2, 3
    pool = jnp.asarray(rng.standard_normal((num_pages, ps, 2 * k_heads, e)), jnp.float32)
    page_indices = jnp.array([[7, 2, 5], [0, 8, 1]], jnp.int32)
    seq_ids = jnp.array([0, 0, 1, 1, -1, 0, 1])
    positions = jnp.array([0, 9, 3, 4, 2, -1, 12])  # the last is past the 3-page block table
    slots = slot_mapping(page_indices, seq_ids, positions, ps)
    np.testing.assert_array_equal(np.asarray(slots), [28, 21, 3, 32, -1, -1, -1])
    k = jnp.asarray(rng.standard_normal((7, k_heads, e)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((7, k_heads, e)), jnp.float32)
    new = np.asarray(write_kv(pool, k, v, slots))
    flat, old = new.reshape(-1, 2 * k_heads, e), np.asarray(pool).reshape(-1, 2 * k_heads, e)
    for t, slot in enumerate([28, 21, 3, 32]):
        np.testing.assert_array_equal(flat[slot, 0::2], np.asarray(k[t]))
        np.testing.assert_array_equal(flat[slot, 1::2], np.asarray(v[t]))
    untouched = np.setdiff1d(np.arange(num_pages * ps), [28, 21, 3, 32])
    np.testing.assert_array_equal(flat[untouched], old[untouched])
    raw = jnp.array([-1, -36, num_pages * ps, 10**6, -1, -1, -1], jnp.int32)  # none valid: -36 must not wrap
    np.testing.assert_array_equal(np.asarray(write_kv(pool, k, v, raw)), np.asarray(pool))


def test_write_kv_donated_in_place():
    """Donated, the pool is updated in place: the input buffer is consumed and jax warns of no unusable
    donation."""
    pool = jnp.zeros((4, 2, 2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jax.jit(write_kv, donate_argnums=0)(pool, jnp.ones((1, 1, 3)), 2 * jnp.ones((1, 1, 3)),
                                                  jnp.array([5], jnp.int32))
    assert pool.is_deleted()
    np.testing.assert_array_equal(np.asarray(out[2, 1, :, 0]), [1.0, 2.0])


def _f32_converts(text, min_elements):
    """bf16 -> f32 converts in StableHLO text whose operand has at least min_elements elements."""
    found = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.convert .*\(tensor<([0-9x]+)xbf16>\) -> tensor<[0-9x]*xf32>", line)
        if m and np.prod([int(d) for d in m.group(1).split("x")]) >= min_elements:
            found.append(line.strip())
    return found


def test_xla_path_keeps_bf16_pages_bf16():
    """No page-sized operand is converted to float32: the lowered program of the XLA path (M given and the
    per-token form) has no bf16 -> f32 convert of anything as large as one sequence's gathered keys
    (W * K * E); q (T * H * E) is kept smaller so that only page-sized converts count. A variant that upcasts
    the pool is caught, so the detector itself works."""
    case = Case(q_lens=(2, 1), kv_lens=(20, 9), group=2, num_rows=3, pages_per_row=8)
    args = make_inputs(case, dtype=jnp.bfloat16)
    window = 32
    min_elements = window * case.num_kv_heads * case.head_dim
    assert args[0].size < min_elements
    for m in (2, None):
        fn = functools.partial(ragged_paged_attention_xla, max_q_per_seq=m, window=window)
        assert _f32_converts(jax.jit(fn).lower(*args).as_text(), min_elements) == []

    def upcast(q, kv, *meta):
        return ragged_paged_attention_xla(q.astype(jnp.float32), kv.astype(jnp.float32), *meta, max_q_per_seq=2)

    assert _f32_converts(jax.jit(upcast).lower(*args).as_text(), min_elements)


def test_xla_path_compiles_once():
    """New lengths, page tables and live counts are arrays: the second call compiles nothing."""
    case = VERIFY
    fn = jax.jit(functools.partial(ragged_paged_attention, impl="xla", max_q_per_seq=5, window=16))
    jax.block_until_ready(fn(*make_inputs(case, seed=9)))
    other = dataclasses.replace(case, q_lens=(2, 5, 1, 1), kv_lens=(3, 16, 1, 2))
    with count_compilations() as n:
        jax.block_until_ready(fn(*make_inputs(other, seed=10)))
    assert n() == 0


def test_validation_messages():
    q, kv, kv_lens, page_indices, cu, num_seqs = make_inputs(DECODE)
    with pytest.raises(ValueError, match="cu_q_lens: expected int32"):
        check_inputs("f", q, kv, kv_lens, page_indices, cu[:-1], num_seqs)
    with pytest.raises(ValueError, match="share a dtype"):
        ragged_paged_attention(q, kv.astype(jnp.bfloat16), kv_lens, page_indices, cu, num_seqs)
    with pytest.raises(ValueError, match="impl"):
        ragged_paged_attention(q, kv, kv_lens, page_indices, cu, num_seqs, impl="cuda")
    with pytest.raises(ValueError, match="window"):
        ragged_paged_attention_xla(q, kv, kv_lens, page_indices, cu, num_seqs, window=6)
    with pytest.raises(ValueError, match="eager only"):
        jax.jit(ragged_paged_attention_reference)(q, kv, kv_lens, page_indices, cu, num_seqs)
