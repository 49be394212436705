"""Hardware-aware prefix scheduler (DSpark Algorithm 1) as pure, jitted functions.

Axis legend: R requests (rows), G drafted tokens per request (block), N length of the dense
steps-per-second table (``sps[b]`` = target steps/s when the verification batch holds ``b`` tokens;
``b >= N`` is infeasible), K candidate budget (a static bound on how many drafts may be admitted).

Every function takes and returns arrays of static shape, so it can be called inside ``jax.jit``,
``lax.scan`` and ``lax.while_loop`` and vmapped over independent groups. Values that change between
calls (which requests are active, the budget ``k``) are arrays, never Python ints.

The algorithm (spec section 3): survival ``a[r, j] = prod_{i<=j} c[r, i]``; candidates ``(r, j)`` with
``a > 0`` are ranked by ``a`` descending, ties by row-major index (so a request's shorter prefix always
comes first); walking the ranking, batch tokens ``B = R + n`` and expected tokens
``tau = R + cumsum(a)``; throughput ``Theta_n = tau_n * SPS(B_n)``.

* ``stop="first_drop"`` (default) admits the prefix of the ranking before the first ``n`` with
  ``Theta_n <= Theta_{n-1}``: exactly Algorithm 1. It is lossless even when the confidence of draft
  ``k + 1`` depends on draft ``k`` (a Markov confidence head), because whether ``(r, k)`` is admitted
  depends only on candidates ranked above it.
* ``stop="argmax"`` admits the prefix up to the best point of the whole greedy path. The two agree
  whenever ``Theta`` along the path is unimodal (e.g. step time convex and non-decreasing in ``B``);
  on jagged measured tables they differ, and the argmax looks ahead at ``c[r, k + 1]`` (which may depend
  on ``x[r, k]``), so with fresh confidences it is NOT lossless (spec appendix A). It is safe only on
  stale confidences, which is how :func:`capacity` uses it.

Beyond a full sort: the number of admitted drafts is bounded by the table (``B < N``), and in practice
the walk stops early. The ranking is therefore built in stages with ``lax.top_k`` (k = 64, 128, 256,
...), each stage run only when the previous one could not decide (``lax.cond``); the last stage is a
stable sort of all ``R * G`` values when the bound is more than half of them. For ``argmax`` a stage
is final when an upper bound on the rest of the path (every later candidate adds at most the current
smallest survival) cannot beat the best point found. Results equal those of a full sort (up to float32
rounding ties in the cumulative sum). Under ``vmap`` the stages become selects and all of them run.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "Schedule",
    "STOP_RULES",
    "survival_probs",
    "sps_lookup",
    "schedule",
    "capacity",
    "top_k_lengths",
    "padded_batch",
    "fill_to_bucket",
    "expected_tokens",
    "check_inputs",
    "schedule_checked",
    "algorithm1_loop",
]

STOP_RULES = ("first_drop", "argmax")
_STAGE_SIZES = tuple(64 * 2**i for i in range(12))
# A stage is final for "argmax" only when the bound on the unexplored path is below the best point by
# this relative margin, so that float rounding can never hide a later, better point.
_BOUND_SLACK = 1e-5


class Schedule(NamedTuple):
    """Result of :func:`schedule`.

    Attributes:
      lengths: int32 [R], drafts to verify per request, each in 0..G (0 for inactive rows).
      batch_tokens: int32 [], ``B = R_active + sum(lengths)``.
      expected_tokens: float32 [], ``tau = R_active + sum_r sum_{j<=l_r} a[r, j]``.
      throughput: float32 [], ``tau * SPS(B)`` (expected tokens per second).

    >>> s = schedule(jnp.array([[0.9, 0.1]]), jnp.array([1.0, 1.0, 1.0, 0.5]))
    >>> int(s.batch_tokens), round(float(s.expected_tokens), 2)
    (2, 1.9)
    """

    lengths: jax.Array
    batch_tokens: jax.Array
    expected_tokens: jax.Array
    throughput: jax.Array


def _active_count(active, num_rows):
    if active is None:
        return jnp.int32(num_rows)
    return jnp.sum(active.astype(jnp.int32))


@jax.jit
def sps_lookup(sps: jax.Array, batch_tokens: jax.Array) -> jax.Array:
    """Steps per second at ``batch_tokens`` (any shape); 0 where the batch is infeasible.

    Args:
      sps: float [N], ``sps[b]`` = steps/s for a batch of ``b`` tokens.
      batch_tokens: int array of any shape.

    Returns:
      float32 array of the same shape as ``batch_tokens``: ``sps[b]`` for ``0 <= b < N``, else 0.

    >>> float(sps_lookup(jnp.array([9.0, 8.0, 4.0]), jnp.int32(1)))
    8.0
    """
    if getattr(sps, "ndim", None) != 1:
        raise ValueError(f"sps: expected a 1-D table [N], got shape {tuple(getattr(sps, 'shape', ()))}")
    n = sps.shape[0]
    b = jnp.asarray(batch_tokens)
    inside = (b >= 0) & (b < n)
    return jnp.where(inside, sps.astype(jnp.float32)[jnp.clip(b, 0, n - 1)], 0.0)


@jax.jit
def survival_probs(confidences: jax.Array, *, active: jax.Array | None = None) -> jax.Array:
    """Prefix survival ``a[r, j] = prod_{i<=j} c[r, i]``, zero for inactive rows.

    The product is taken left to right in float32 (the same rounding as ``np.cumprod``), so ``a`` is
    non-increasing along each row. Survivals below the smallest normal float32 (~1.2e-38) are set to
    exactly 0, so every backend agrees whether or not it flushes subnormals.

    Inside jit nothing can raise, so the contract is enforced by value: a NaN confidence counts as 0 (that
    draft and the rest of its row are never verified) and values outside [0, 1] are clipped. Outside jit,
    :func:`check_inputs` / :func:`schedule_checked` reject such input with a ``ValueError``.

    Args:
      confidences: float [R, G] in [0, 1].
      active: optional bool [R].

    Returns:
      float32 [R, G].

    >>> survival_probs(jnp.array([[0.5, 0.5, 1.0]])).tolist()
    [[0.5, 0.25, 0.25]]
    >>> survival_probs(jnp.array([[5.0, jnp.nan, 1.0]])).tolist()
    [[1.0, 0.0, 0.0]]
    """
    _check_confidences(confidences, active)
    c = jnp.clip(jnp.nan_to_num(confidences.astype(jnp.float32), nan=0.0), 0.0, 1.0)
    cols = [c[:, 0]]
    for j in range(1, c.shape[1]):
        cols.append(cols[-1] * c[:, j])
    a = jnp.stack(cols, axis=1)
    a = jnp.where(a >= jnp.finfo(jnp.float32).tiny, a, 0.0)
    if active is not None:
        a = jnp.where(active[:, None], a, 0.0)
    return a


def _ranked(a_flat, k, full):
    """Top ``k`` of ``a_flat`` descending, ties by lower index first: (values [k], indices [k])."""
    if full:
        neg, idx = lax.sort((-a_flat, lax.iota(jnp.int32, a_flat.shape[0])), num_keys=1, is_stable=True)
        return -neg[:k], idx[:k]
    # XLA's TopK returns equal elements lower index first, the tie rule the ranking needs.
    return lax.top_k(a_flat, k)


def _stage_plan(num_candidates: int, k_max: int):
    """Static list of (k, full_sort) stages ending with one that covers ``k_max`` candidates."""
    if k_max * 2 > num_candidates:
        final = (num_candidates, True)
    else:
        final = (k_max, False)
    stages = [(k, False) for k in _STAGE_SIZES if 2 * k < final[0]]
    return stages + [final]


def _prefix_lengths(a, vals, idx, n_adm):
    """Lengths [R] when the top ``n_adm`` of the ranking (vals, idx) are admitted.

    The admitted set is every candidate ranked above the last admitted one: a larger survival, or
    the same survival at a lower row-major index. Row order makes each admitted set a prefix.
    """
    num_rows, block = a.shape
    last = jnp.maximum(n_adm - 1, 0)
    v_star, i_star = vals[last], idx[last]
    flat = lax.broadcasted_iota(jnp.int32, (num_rows, block), 0) * block + lax.broadcasted_iota(
        jnp.int32, (num_rows, block), 1
    )
    admitted = (a > v_star) | ((a == v_star) & (flat <= i_star))
    admitted = admitted & (n_adm > 0)
    return jnp.sum(admitted, axis=1, dtype=jnp.int32)


def _walk(a, r_act, sps, stop, k_max):
    """Greedy path over the ranking with the given stop rule: (lengths, n_adm, tau, theta)."""
    num_rows, block = a.shape
    n_table = sps.shape[0]
    a_flat = a.reshape(-1)
    stages = _stage_plan(num_rows * block, k_max)
    theta0 = r_act.astype(jnp.float32) * sps_lookup(sps, r_act)
    total_mass = r_act.astype(jnp.float32) + jnp.sum(a)

    def stage(i):
        k, full = stages[i]
        final = i == len(stages) - 1
        vals, idx = _ranked(a_flat, k, full)
        n = jnp.arange(1, k + 1, dtype=jnp.int32)
        batch = r_act + n  # [K]
        tau = r_act.astype(jnp.float32) + jnp.cumsum(vals)  # [K]
        ok = (vals > 0) & (batch < n_table)
        rate = sps_lookup(sps, batch)  # [K]
        theta = jnp.where(ok, tau * rate, -jnp.inf)
        path = jnp.concatenate([theta0[None], theta])  # [K + 1], path[n] = Theta_n
        if stop == "first_drop":
            # Theta_n > Theta_{n-1}  <=>  a_n * s_n > tau_{n-1} * (s_{n-1} - s_n). The difference form
            # has no cancellation: on a flat table every positive survival raises the throughput,
            # however small it is next to tau.
            rate_prev = jnp.concatenate([sps_lookup(sps, r_act)[None], rate[:-1]])
            tau_prev = jnp.concatenate([r_act.astype(jnp.float32)[None], tau[:-1]])
            drop = ~(ok & (vals * rate > tau_prev * (rate_prev - rate)))
            found = jnp.any(drop)
            n_adm = jnp.where(found, jnp.argmax(drop), k).astype(jnp.int32)
            decided = found
        else:
            n_adm = jnp.argmax(path).astype(jnp.int32)  # first maximum: ties keep the shorter path
            best = path[n_adm]
            # Every later candidate adds at most vals[k-1] to tau, and all of them together at most the
            # survival mass not yet ranked: bound Theta_m for m in k+1..k_max.
            m = jnp.arange(k + 1, max(k_max, k) + 1, dtype=jnp.int32)
            rest = jnp.maximum(total_mass - tau[k - 1], 0.0) * (1 + _BOUND_SLACK)
            gain = jnp.minimum((m - k).astype(jnp.float32) * vals[k - 1], rest)
            bound = (tau[k - 1] + gain) * sps_lookup(sps, r_act + m)
            decided = (vals[k - 1] <= 0) | (jnp.max(bound, initial=-jnp.inf) < best * (1 - _BOUND_SLACK))
        tau_adm = jnp.where(n_adm > 0, tau[jnp.maximum(n_adm - 1, 0)], r_act.astype(jnp.float32))
        out = (_prefix_lengths(a, vals, idx, n_adm), n_adm, tau_adm, path[n_adm])
        if final:
            return out
        return lax.cond(decided, lambda: out, lambda: stage(i + 1))

    return stage(0)


def _check_confidences(confidences, active, name="confidences"):
    """Static checks (at trace time, free under jit): confidences [R, G] with R, G >= 1, active [R]."""
    if not hasattr(confidences, "ndim"):
        raise ValueError(f"{name}: expected an array [R, G], got {type(confidences).__name__} (jnp.asarray it)")
    if confidences.ndim != 2 or 0 in confidences.shape:
        raise ValueError(f"{name} must have shape [R, G] with R, G >= 1, got shape {tuple(confidences.shape)}")
    if active is not None and tuple(getattr(active, "shape", ())) != confidences.shape[:1]:
        raise ValueError(f"active must have shape [R] = [{confidences.shape[0]}] (one flag per row of {name}), got "
                         f"{tuple(getattr(active, 'shape', ()))}")
    if active is not None and getattr(active, "dtype", None) != jnp.bool_:
        raise ValueError(f"active must be bool [R] (True for a request in the batch), got dtype "
                         f"{getattr(active, 'dtype', type(active).__name__)}")


def _check_static(confidences, sps, stop, active=None, name="confidences"):
    _check_confidences(confidences, active, name)
    if not hasattr(sps, "ndim") or sps.ndim != 1 or sps.shape[0] < 1:
        raise ValueError(f"sps must have shape [N] with N >= 1, got shape {tuple(getattr(sps, 'shape', ()))}")
    if stop not in STOP_RULES:
        raise ValueError(f"stop must be one of {STOP_RULES}, got {stop!r}")


def _k_max(confidences, sps):
    num_rows, block = confidences.shape
    return max(1, min(num_rows * block, sps.shape[0] - 1))


@functools.partial(jax.jit, static_argnames=("stop",))
def schedule(
    confidences: jax.Array,
    sps: jax.Array,
    *,
    active: jax.Array | None = None,
    stop: str = "first_drop",
) -> Schedule:
    """Choose how many drafts each request verifies (DSpark Algorithm 1).

    Args:
      confidences: float [R, G] in [0, 1]; ``c[r, k]`` = chance draft ``k`` survives given the earlier
        drafts of row ``r`` did.
      sps: float [N], positive; ``sps[b]`` = target steps/s at ``b`` batch tokens; ``b >= N`` infeasible.
      active: optional bool [R]; inactive rows verify nothing and add nothing to ``B``.
      stop: ``"first_drop"`` (Algorithm 1, lossless, default) or ``"argmax"`` (best point of the greedy
        path; lossless only on confidences that do not depend on this round's drafts).

    Returns:
      :class:`Schedule` with ``lengths`` int32 [R], ``batch_tokens`` int32 [],
      ``expected_tokens`` float32 [] and ``throughput`` float32 [].

    >>> s = schedule(jnp.array([[0.9, 0.1]]), jnp.array([1.0, 1.0, 1.0, 0.5]))
    >>> s.lengths.tolist(), int(s.batch_tokens)
    ([1], 2)
    """
    _check_static(confidences, sps, stop, active)
    a = survival_probs(confidences, active=active)
    r_act = _active_count(active, confidences.shape[0])
    lengths, n_adm, tau, theta = _walk(a, r_act, sps, stop, _k_max(confidences, sps))
    # B from the lengths themselves (n_adm equals their sum as long as top-k keeps equal values in index order)
    return Schedule(lengths, r_act + jnp.sum(lengths, dtype=jnp.int32), tau, theta)


@jax.jit
def capacity(stale_confidences: jax.Array, sps: jax.Array, *, active: jax.Array | None = None) -> jax.Array:
    """Batch draft capacity K from stale confidences (production variant, spec section 3).

    K is the number of drafts at the best point of the greedy path built from confidences that are
    known before this round's drafts exist (e.g. two rounds old). Because K does not depend on this
    round's tokens, verifying the top-K candidates by current survival (:func:`top_k_lengths`) is
    lossless, and the argmax over the path is safe here.

    Args:
      stale_confidences: float [R, G] in [0, 1].
      sps: float [N], positive steps/s table.
      active: optional bool [R].

    Returns:
      int32 [], the number of drafts to verify in the whole batch.

    >>> int(capacity(jnp.array([[0.9, 0.9]]), jnp.array([1.0, 1.0, 1.0, 1.0])))
    2
    """
    _check_static(stale_confidences, sps, "argmax", active, "stale_confidences")
    a = survival_probs(stale_confidences, active=active)
    r_act = _active_count(active, stale_confidences.shape[0])
    _, n_adm, _, _ = _walk(a, r_act, sps, "argmax", _k_max(stale_confidences, sps))
    return n_adm


@jax.jit
def top_k_lengths(confidences: jax.Array, k: jax.Array, *, active: jax.Array | None = None) -> jax.Array:
    """Verify the ``k`` candidates of highest current survival (ties: row-major order).

    Candidates with zero survival are never admitted, so fewer than ``k`` drafts may be verified.
    A prefix is always admitted before its extension, so the admission of draft ``(r, j)`` never looks
    at draft ``(r, j)`` itself. ``k`` is taken as given: the verified batch is ``R_active + k`` at most, so
    a ``k`` from :func:`capacity` at another number of active requests may price a batch the SPS table
    does not hold (take ``k`` from the current one, as the engine does).

    Args:
      confidences: float [R, G] in [0, 1].
      k: int [], the batch capacity (e.g. from :func:`capacity`); may be traced.
      active: optional bool [R].

    Returns:
      int32 [R] lengths, each in 0..G.

    >>> top_k_lengths(jnp.array([[0.9, 0.9], [0.5, 1.0]]), jnp.int32(3)).tolist()
    [2, 1]
    """
    _check_confidences(confidences, active)
    a = survival_probs(confidences, active=active)
    num = a.size
    a_flat = a.reshape(-1)
    k = jnp.asarray(k, jnp.int32)
    stages = _stage_plan(num, num)

    def stage(i):
        ks, full = stages[i]
        vals, idx = _ranked(a_flat, ks, full)
        n_adm = jnp.minimum(jnp.clip(k, 0, ks), jnp.sum(vals > 0, dtype=jnp.int32))
        out = _prefix_lengths(a, vals, idx, n_adm)
        if i == len(stages) - 1:
            return out
        decided = (k <= ks) | (vals[ks - 1] <= 0)
        return lax.cond(decided, lambda: out, lambda: stage(i + 1))

    return stage(0)


def padded_batch(batch: jax.Array, buckets: jax.Array) -> jax.Array:
    """The smallest of ``buckets`` (int [U], increasing) that holds ``batch`` tokens, or ``batch`` itself
    beyond the last: ``llama.bucket_for`` for traced values (int32 [])."""
    buckets = jnp.asarray(buckets, jnp.int32)
    at = jnp.searchsorted(buckets, batch, side="left")
    return jnp.where(at < buckets.shape[0], buckets[jnp.clip(at, 0, buckets.shape[0] - 1)], batch).astype(jnp.int32)


@jax.jit
def fill_to_bucket(confidences: jax.Array, lengths: jax.Array, buckets: jax.Array, *,
                   active: jax.Array | None = None) -> jax.Array:
    """Extend a schedule to the padded batch the engine verifies anyway.

    An engine that pads the batch ``B = R_active + sum(lengths)`` to the next bucket ``T >= B`` pays for
    ``T`` tokens whatever it puts there; this admits the next candidates of the same ranking (survival
    descending, ties row-major) until the batch holds ``T`` tokens or no candidate with positive survival
    is left. A schedule that verifies no draft stays empty (that round runs without drafts).

    Lossless when ``lengths`` admits a prefix of the ranking chosen from the candidates ranked at or above
    its last admitted one (Algorithm 1's first drop, or a top-K with K known before the drafts): then ``T``
    depends only on them, and a candidate the fill admits is ranked below them and is admitted by its rank
    alone. The draft ``(r, k + 1)``, whose survival may depend on ``x[r, k]``, ranks below ``(r, k)``, so
    the admission of ``x[r, k]`` still never looks at ``x[r, k]``.

    Args:
      confidences: float [R, G] in [0, 1], the ones ``lengths`` was scheduled from.
      lengths: int [R], a prefix of the ranking (e.g. :func:`schedule`'s).
      buckets: int [U], the engine's padded batch sizes, increasing; a batch beyond the last is left as is.
      active: optional bool [R].

    Returns:
      int32 [R] lengths, each ``>=`` the given one.

    >>> conf = jnp.array([[0.9, 0.5], [0.8, 0.1]])  # survival [[0.9, 0.45], [0.8, 0.08]]
    >>> fill_to_bucket(conf, jnp.array([1, 0]), jnp.array([1, 2, 4, 8])).tolist()  # B = 3 -> 4
    [1, 1]
    >>> fill_to_bucket(conf, jnp.array([1, 1]), jnp.array([1, 2, 4, 8])).tolist()  # B = 4 stays
    [1, 1]
    >>> fill_to_bucket(conf, jnp.array([2, 1]), jnp.array([1, 2, 4, 8])).tolist()  # B = 5 -> 8: all
    [2, 2]
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    r_act = _active_count(active, confidences.shape[0])
    drafts = jnp.sum(jnp.where(active, lengths, 0) if active is not None else lengths, dtype=jnp.int32)
    k = jnp.where(drafts > 0, padded_batch(r_act + drafts, buckets) - r_act, 0)
    return jnp.maximum(lengths, top_k_lengths(confidences, k, active=active))


@jax.jit
def expected_tokens(confidences: jax.Array, lengths: jax.Array, *, active: jax.Array | None = None) -> jax.Array:
    """Expected tokens a round emits when row ``r`` verifies ``lengths[r]`` drafts: ``R_active + sum_r
    sum_{j <= l_r} a[r, j]`` (float32 [])."""
    a = survival_probs(confidences, active=active)
    j = lax.broadcasted_iota(jnp.int32, a.shape, 1)
    taken = jnp.sum(jnp.where(j < jnp.asarray(lengths, jnp.int32)[:, None], a, 0.0))
    return (_active_count(active, confidences.shape[0]).astype(jnp.float32) + taken).astype(jnp.float32)


def check_inputs(confidences, sps, *, active=None) -> None:
    """Validate scheduler inputs on the host; raise ``ValueError`` naming what is wrong.

    Checks the rank and shapes, that confidences are finite and within [0, 1], that the SPS table
    is finite and positive, and that it is long enough for the active requests (``N > R_active``).
    """
    conf = np.asarray(confidences)
    table = np.asarray(sps)
    if conf.ndim != 2:
        raise ValueError(f"confidences: expected a 2-D array [R, G], got shape {conf.shape}")
    if conf.shape[0] < 1 or conf.shape[1] < 1:
        raise ValueError(f"confidences: expected R >= 1 and G >= 1, got shape {conf.shape}")
    if not np.issubdtype(conf.dtype, np.floating):
        raise ValueError(f"confidences: expected a float array, got dtype {conf.dtype}")
    if np.isnan(conf).any():
        raise ValueError(f"confidences: contains NaN at {np.argwhere(np.isnan(conf))[0].tolist()}")
    bad = (conf < 0) | (conf > 1)
    if bad.any():
        r, g = np.argwhere(bad)[0]
        raise ValueError(f"confidences: expected values in [0, 1], got {float(conf[r, g])} at [{r}, {g}]")
    if table.ndim != 1 or table.shape[0] < 1:
        raise ValueError(f"sps: expected a 1-D table [N] with N >= 1, got shape {table.shape}")
    if not np.isfinite(table).all() or (table <= 0).any():
        i = int(np.argwhere(~np.isfinite(table) | (table <= 0))[0, 0])
        raise ValueError(f"sps: expected finite, positive steps/s, got {float(table[i])} at index {i}")
    if active is None:
        r_act = conf.shape[0]
    else:
        act = np.asarray(active)
        if act.shape != (conf.shape[0],):
            raise ValueError(f"active: expected shape ({conf.shape[0]},) to match confidences, got {act.shape}")
        if act.dtype != np.bool_:
            raise ValueError(f"active: expected a bool array, got dtype {act.dtype}")
        r_act = int(act.sum())
    if table.shape[0] <= r_act:
        raise ValueError(
            f"sps: table of length {table.shape[0]} is too short for {r_act} active requests "
            f"(a batch of B tokens needs sps[B]; expected length > {r_act})"
        )


def schedule_checked(confidences, sps, *, active=None, stop: str = "first_drop") -> Schedule:
    """:func:`schedule` behind host-side checks (:func:`check_inputs`): use it outside jit, where bad input should
    raise instead of being read by value (NaN as 0, values clipped to [0, 1]).

    Args:
      confidences: float [R, G] in [0, 1]; sps: float [N] finite, positive steps/s with N > R_active;
      active: optional bool [R]; stop: one of ``STOP_RULES``.
    Returns:
      :class:`Schedule`.

    >>> int(schedule_checked([[0.9, 0.1]], [1.0, 1.0, 1.0, 0.5]).batch_tokens)
    2
    >>> schedule_checked([[0.9, 1.5]], [1.0, 1.0, 1.0])
    Traceback (most recent call last):
    ValueError: confidences: expected values in [0, 1], got 1.5 at [0, 1]
    """
    if stop not in STOP_RULES:
        raise ValueError(f"stop: expected one of {STOP_RULES}, got {stop!r}")
    check_inputs(confidences, sps, active=active)
    act = None if active is None else jnp.asarray(active)
    return schedule(jnp.asarray(confidences, jnp.float32), jnp.asarray(sps, jnp.float32), active=act, stop=stop)


def algorithm1_loop(conf, sps, active=None):
    """Algorithm 1 written as the spec's plain Python loop (reference for tests and benchmarks).

    Returns ``(lengths, batch_tokens, tau, theta, min_rel_gap)`` computed in float64 from the float32
    survival; ``min_rel_gap`` is the smallest relative gap of any comparison the loop made (below ~1e-5
    the float32 :func:`schedule` may legitimately decide the other way).
    """
    a = np.cumprod(np.asarray(conf, np.float32), axis=1, dtype=np.float32)
    a = np.where(a >= np.finfo(np.float32).tiny, a, np.float32(0))
    if active is not None:
        a = np.where(np.asarray(active)[:, None], a, np.float32(0))

    def sps_at(b):
        return float(sps[b]) if 0 <= b < len(sps) else 0.0

    rows, block = a.shape
    r_act = rows if active is None else int(np.sum(active))
    cands = [(r, j) for r in range(rows) for j in range(block) if a[r, j] > 0]
    cands.sort(key=lambda rj: -float(a[rj]))
    lengths = [0] * rows
    b, tau = r_act, float(r_act)
    best = tau * sps_at(b)
    gap = np.inf
    for r, j in cands:
        s_prev, s_next = sps_at(b), sps_at(b + 1)
        theta = (tau + float(a[r, j])) * s_next
        # Theta gains a*s_next and loses tau*(s_prev - s_next): a tie when those nearly cancel.
        gain, loss = float(a[r, j]) * s_next, tau * (s_prev - s_next)
        if gain + abs(loss) > 0:
            gap = min(gap, abs(gain - loss) / (gain + abs(loss)))
        # theta - best == gain - loss (best is always tau * s_prev here); comparing the difference keeps a
        # tiny survival from being absorbed by the sum, as it would be in ``theta > best``.
        if gain > loss:
            best = theta
            b += 1
            tau += float(a[r, j])
            lengths[r] = j + 1
        else:
            break
    return np.array(lengths), b, tau, best, gap
