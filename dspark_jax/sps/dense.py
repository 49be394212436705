"""What the scheduler reads inside jit: attention windows, the cost model's arrays, and the dense steps/s
array for the round's requests and context (`sps_from_cost`), rebuilt every round without compiling again.

Axis legend: C measured context windows, R measured row counts, B verification tokens (0..N-1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["WINDOW_RULES", "DEFAULT_WINDOW_RULE", "context_window", "round_windows", "window_mix", "CostArrays", "sps_from_cost",
           "plain_sps_from_cost"]


WINDOW_RULES = ("pow2", "step")
# The engine's rule and the profiler's default (one source: a table profiled with the defaults is one the default
# engine takes): the engine reads caches in parts of `models.llama.CONTEXT_STEP` positions, which "step" prices.
DEFAULT_WINDOW_RULE = "step"


def context_window(n_tokens, step: int = 128, rule: str = "pow2"):
    """The attention window that holds positions below ``n_tokens`` (no capacity cap).

    ``rule="pow2"``: the smallest power of two ``>= max(n_tokens, step)`` (the engine's windows);
    ``rule="step"``: ``n_tokens`` rounded up to a multiple of ``step``, at least ``step``
    (``llama.context_bucket``). Works on Python ints and on JAX int32 arrays (inside ``jit``).

    >>> context_window(136), context_window(128), context_window(136, rule="step")
    (256, 128, 256)
    """
    if rule not in WINDOW_RULES:
        raise ValueError(f"rule: expected one of {WINDOW_RULES}, got {rule!r}")
    if isinstance(n_tokens, jax.Array):
        n = jnp.maximum(n_tokens.astype(jnp.int32), step)
        if rule == "step":
            return ((n + step - 1) // step) * step
        return jnp.left_shift(jnp.int32(1), 32 - lax.clz(n - 1))  # bit length of n - 1
    n = max(int(n_tokens), step)
    if rule == "step":
        return -(-n // step) * step
    return 1 << (n - 1).bit_length()


def round_windows(context_tokens, block: int, step: int = 128, rule: str = "pow2"):
    """``(verification window, draft window)`` of a round whose longest request holds ``context_tokens``.

    >>> round_windows(120, 7), round_windows(128, 7)
    ((128, 128), (256, 128))
    """
    return (context_window(context_tokens + block + 1, step, rule), context_window(context_tokens, step, rule))


def window_mix(xp, windows, per_ctx, w):
    """Value at window ``w`` from per-window values ``per_ctx`` [C, ...]: linear between measured windows,
    clamped below the first, extrapolated along the last segment (slope >= 0) beyond the last."""
    if per_ctx.shape[0] == 1:
        return per_ctx[0]
    i = xp.clip(xp.searchsorted(windows, w, side="right") - 1, 0, windows.shape[0] - 2)
    w0, w1 = windows[i], windows[i + 1]
    t0, t1 = per_ctx[i], per_ctx[i + 1]
    frac = (w - w0) / (w1 - w0)
    inside = xp.clip(frac, 0.0, 1.0)
    beyond = xp.maximum(frac - 1.0, 0.0)
    return t0 + inside * (t1 - t0) + beyond * xp.maximum(t1 - t0, 0.0)


@dataclasses.dataclass(frozen=True)
class CostArrays:
    """:class:`CostModel` as arrays (a pytree; ``block``, ``context_step`` and ``window_rule`` are static).

    Attributes:
      windows, draft_windows: float32 [C] measured verification and draft windows.
      rows: int32 [R] measured row counts (row buckets).
      verify_s: float32 [C, R, N] verification seconds plus the drafting round's overhead for ``b = 0..N-1``
        batch tokens (:meth:`CostModel.drafting_grid`, non-decreasing in ``b``).
      draft_s: float32 [C, R] draft seconds.
      plain_s: float32 [C, R] seconds of a plain round (no drafts) at each row count.
      plain_overhead_s: float32 [R] seconds a plain engine round takes beyond the plain program (zeros when
        not profiled).
    """

    windows: jax.Array
    draft_windows: jax.Array
    rows: jax.Array
    verify_s: jax.Array
    draft_s: jax.Array
    plain_s: jax.Array
    plain_overhead_s: jax.Array
    block: int
    context_step: int
    window_rule: str


jax.tree_util.register_dataclass(CostArrays, data_fields=["windows", "draft_windows", "rows", "verify_s", "draft_s",
                                                                "plain_s", "plain_overhead_s"],
                                 meta_fields=["block", "context_step", "window_rule"])


@functools.partial(jax.jit, static_argnames=("envelope",))
def sps_from_cost(cost: CostArrays, num_requests: jax.Array, context_tokens: jax.Array, *,
                  envelope: bool = False) -> jax.Array:
    """Dense steps/s table for the scheduler, for this round's load, inside ``jit``.

    ``num_requests`` and ``context_tokens`` are arrays, so a new load never compiles again. The rows are
    charged at the smallest measured row count ``>= num_requests`` (contract: ``1 <= num_requests <=
    rows[-1]``, checked on the host by :meth:`CostModel.check_query`; larger values are charged as the
    largest row count). Windows: :func:`round_windows` and the module docstring.

    Args:
      cost: :class:`CostArrays` from :meth:`CostModel.arrays` (or :meth:`SPSTable.cost_arrays`).
      num_requests: int [] active requests R.
      context_tokens: int [] tokens held by the longest active request L.
      envelope: replace step time by its suffix minimum over ``b`` (non-increasing steps/s).

    Returns:
      float32 [N], ``sps[b] = 1 / max_{b' <= b} (draft(R, Wd(L)) + verify(R, b', Wv(L)) + overhead(drafting,
      R, b'))``: step time non-decreasing in ``b`` (measurement noise never makes a larger batch cheaper).

    >>> from dspark_jax.sps.cost_model import CostModel
    >>> cm = CostModel(block=1, context_step=128, window_rule="pow2", context_lengths=(0, 200),
    ...                windows=(128, 256), draft_windows=(128, 256), rows=(1, 2), batch_tokens=(2, 4),
    ...                verify_s=(((1.0, None), (1.0, 2.0)), ((2.0, None), (2.0, 4.0))),
    ...                verify_spread_s=(((0.0, None), (0.0, 0.0)), ((0.0, None), (0.0, 0.0))),
    ...                draft_s=((0.0, 0.0), (0.0, 0.0)), draft_spread_s=((0.0, 0.0), (0.0, 0.0)))
    >>> [round(x, 4) for x in sps_from_cost(cm.arrays(), jnp.int32(2), jnp.int32(0)).tolist()]
    [1.0, 1.0, 1.0, 0.6667, 0.5]
    """
    num = jnp.asarray(num_requests, jnp.int32)
    r = jnp.clip(jnp.searchsorted(cost.rows, num, side="left"), 0, cost.rows.shape[0] - 1)
    wv, wd = round_windows(jnp.asarray(context_tokens, jnp.int32), cost.block, cost.context_step, cost.window_rule)
    verify = window_mix(jnp, cost.windows, cost.verify_s[:, r, :], wv.astype(jnp.float32))  # [N]
    draft = window_mix(jnp, cost.draft_windows, cost.draft_s[:, r], wd.astype(jnp.float32))  # []
    t = lax.cummax(verify + draft, axis=0)  # more tokens never cost less
    if envelope:
        t = lax.cummin(t, axis=0, reverse=True)
    return (1.0 / t).astype(jnp.float32)


@jax.jit
def plain_sps_from_cost(cost: CostArrays, num_requests: jax.Array, context_tokens: jax.Array) -> jax.Array:
    """Plain rounds per second (no drafter, one token per request) for this round's load, inside ``jit``:
    float32 []. The reference the engine's drafter gate compares a drafting round against."""
    num = jnp.asarray(num_requests, jnp.int32)
    r = jnp.clip(jnp.searchsorted(cost.rows, num, side="left"), 0, cost.rows.shape[0] - 1)
    wv, _ = round_windows(jnp.asarray(context_tokens, jnp.int32), cost.block, cost.context_step, cost.window_rule)
    plain = window_mix(jnp, cost.windows, cost.plain_s[:, r], wv.astype(jnp.float32)) + cost.plain_overhead_s[r]
    return (1.0 / plain).astype(jnp.float32)
