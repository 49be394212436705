"""The cost of a decoding round measured on a grid (`CostModel`): its validation, the monotone clean-up of
timing noise, and the price of a round for given requests, verified tokens and context.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from dspark_jax.sps.dense import WINDOW_RULES, CostArrays, round_windows, window_mix

__all__ = ["INTERPOLATIONS", "OVERHEAD_KINDS", "CostModel", "interpolate_step_times", "realistic_rows",
           "nondecreasing", "monotone_minorant"]

INTERPOLATIONS = ("linear", "ceil")


def interpolate_step_times(xs: np.ndarray, ts: np.ndarray, b: np.ndarray, interpolation: str) -> np.ndarray:
    """Step times ``ts`` measured at increasing ``xs``, read at ``b``: linear (constant below the first
    point) or ceil (the next measured point; the last one beyond it)."""
    if interpolation == "linear":
        return np.interp(b, xs, ts)
    return ts[np.minimum(np.searchsorted(xs, b, side="left"), len(xs) - 1)]


def realistic_rows(batch_tokens: int, *, max_rows: int = 64, tokens_per_request: int = 4) -> int:
    """The row count the simple SPS(B) curve assumes for a batch of ``batch_tokens``: ``B //
    tokens_per_request`` requests (each verifying a few drafts plus its anchor), at least 1, rounded up
    to a power of two (the engine's row bucket), at most ``max_rows``.

    >>> [realistic_rows(b) for b in (1, 8, 64, 256, 512)]
    [1, 2, 16, 64, 64]
    """
    want = max(1, int(batch_tokens) // int(tokens_per_request))
    return int(min(int(max_rows), 1 << (want - 1).bit_length()))


def _nested(obj, depth: int):
    """Lists (from JSON) -> nested tuples, ``depth`` levels deep (NumPy scalars -> Python numbers)."""
    if depth == 0:
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        return obj
    if not isinstance(obj, (list, tuple)):
        raise TypeError(f"expected a list, got {type(obj).__name__}")
    return tuple(_nested(x, depth - 1) for x in obj)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _int_axis(name: str, values, *, minimum: int) -> None:
    if not values:
        raise ValueError(f"cost model: {name} must not be empty")
    prev = None
    for v in values:
        if not _is_int(v) or v < minimum:
            raise ValueError(f"cost model: {name} must hold integers >= {minimum}, got {v!r} in {list(values)}")
        if prev is not None and v <= prev:
            raise ValueError(f"cost model: {name} must be strictly increasing, got {list(values)}")
        prev = v


def nondecreasing(y: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit of ``y`` [T] (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in np.asarray(y, np.float64):
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return np.concatenate([np.full(int(n), total / n) for total, n in blocks])


def monotone_minorant(y, axes) -> np.ndarray:
    """The greatest array below ``y`` that is non-decreasing along each of ``axes``: a suffix minimum along
    each axis in turn (a suffix minimum along one axis keeps the array non-decreasing along the others).

    Timing noise on a shared host only ever adds time, so where two measured cells are out of order (a longer
    context, more rows or more tokens measured faster) the faster one is the better estimate of both: the
    slower cell is lowered to it, the faster one is kept."""
    out = np.asarray(y, np.float64)
    for axis in axes:
        out = np.flip(np.minimum.accumulate(np.flip(out, axis), axis=axis), axis)
    return out


# The two kinds of round the cost model's overhead_s distinguishes, in its order.
OVERHEAD_KINDS = ("drafting", "plain")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Measured seconds per round on a grid: context length x rows x verification tokens.

    Axes: ``context_lengths`` [C] (tokens held per request when measured), with the attention windows
    the engine compiles for them, ``windows`` [C] for verification and ``draft_windows`` [C] for the
    drafter (:func:`round_windows` under ``window_rule`` and ``context_step``; both strictly increasing);
    ``rows`` [R] (row buckets: a round with ``r`` active requests runs at the smallest measured row count
    ``>= r``); ``batch_tokens`` [T] (padded verification sizes, the engine's buckets). ``block`` is G:
    verification holds at most ``G + 1`` tokens per request, so ``B <= rows * (G + 1)``.

    ``verify_s[c][r][t]`` is the median verification time (``None``: not measured; a round with
    ``rows[r]`` rows never needs ``B`` beyond ``rows[r] * (G + 1)``, and a batch of ``t`` tokens needs
    more than ``rows[r - 1]`` requests). Missing cells are filled conservatively (:meth:`filled_verify`):
    from the next measured batch of the same row (padding up), else from the next larger row count at the
    same batch. The largest row count must be measured at the largest batch, at every context length.
    ``draft_s[c][r]`` is the drafter's time for a block of every row (0 when no drafter was measured).
    ``overhead_s[k][r]`` (optional; zeros when absent) is what a whole engine round at ``rows[r]`` takes
    beyond those programs, for a drafting round (``k = 0``) and a plain round (``k = 1``): the host's share
    of the round, the engine's bookkeeping programs and the drafter's context write, measured by running
    the engine (``measure.profile_round_overhead``); it is added to every round time of its kind.
    ``draft_overhead_s[r][t]`` (optional, needs ``overhead_s``) refines the drafting round's overhead by
    the padded batch ``batch_tokens[t]`` it verified (``None``: not measured): what the engine adds beyond
    the programs depends on the batch, and a correction measured at full blocks misprices a round that
    verifies a few drafts. Missing cells are filled from the next measured batch of the row, else the
    largest measured one, else ``overhead_s[0][r]``; between batches it is interpolated like ``verify_s``.
    Spreads are half the interquartile range of the repeats, in seconds.
    """

    block: int
    context_step: int
    window_rule: str
    context_lengths: tuple[int, ...]
    windows: tuple[int, ...]
    draft_windows: tuple[int, ...]
    rows: tuple[int, ...]
    batch_tokens: tuple[int, ...]
    verify_s: tuple  # [C][R][T] float or None
    verify_spread_s: tuple  # [C][R][T] float or None (None exactly where verify_s is None)
    draft_s: tuple  # [C][R] float
    draft_spread_s: tuple  # [C][R] float
    # A plain round (no drafts: one token per request, ``max_per_slot = 1``) at each row count, as the engine
    # runs it when a round schedules nothing: [C][R] seconds, or None (then read from verify_s at B = rows).
    plain_s: tuple | None = None
    plain_spread_s: tuple | None = None
    # Seconds an engine round takes beyond the profiled programs: [2][R] over OVERHEAD_KINDS.
    overhead_s: tuple | None = None
    overhead_spread_s: tuple | None = None
    # The drafting round's overhead by padded batch: [R][T] seconds or None (not measured); needs overhead_s.
    draft_overhead_s: tuple | None = None
    draft_overhead_spread_s: tuple | None = None

    _DEPTHS = {"context_lengths": 1, "windows": 1, "draft_windows": 1, "rows": 1, "batch_tokens": 1,
               "verify_s": 3, "verify_spread_s": 3, "draft_s": 2, "draft_spread_s": 2, "plain_s": 2,
               "plain_spread_s": 2, "overhead_s": 2, "overhead_spread_s": 2, "draft_overhead_s": 2,
               "draft_overhead_spread_s": 2}
    _OPTIONAL = ("plain_s", "plain_spread_s", "overhead_s", "overhead_spread_s", "draft_overhead_s",
                 "draft_overhead_spread_s")

    def __post_init__(self):
        for name, depth in self._DEPTHS.items():
            if name in self._OPTIONAL and getattr(self, name) is None:
                continue
            try:
                object.__setattr__(self, name, _nested(getattr(self, name), depth))
            except TypeError as e:
                raise ValueError(f"cost model: {name} must be nested {depth} deep: {e}") from None
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        for name in ("block", "context_step"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"cost model: {name} must be an integer >= 1, got {v!r}")
        if self.window_rule not in WINDOW_RULES:
            raise ValueError(f"cost model: window_rule must be one of {WINDOW_RULES}, got {self.window_rule!r}")
        _int_axis("context_lengths", self.context_lengths, minimum=0)
        _int_axis("rows", self.rows, minimum=1)
        _int_axis("batch_tokens", self.batch_tokens, minimum=1)
        C, R, T = len(self.context_lengths), len(self.rows), len(self.batch_tokens)
        want = [round_windows(L, self.block, self.context_step, self.window_rule) for L in self.context_lengths]
        for name, k in (("windows", 0), ("draft_windows", 1)):
            have = list(getattr(self, name))
            expect = [w[k] for w in want]
            if have != expect:
                raise ValueError(f"cost model: {name} must be {expect} for context lengths {list(self.context_lengths)} "
                                 f"(rule {self.window_rule!r}, step {self.context_step}, block {self.block}), got {have}")
            _int_axis(name, have, minimum=1)
        for name, shape in (("verify_s", (C, R, T)), ("verify_spread_s", (C, R, T)), ("draft_s", (C, R)),
                            ("draft_spread_s", (C, R))):
            self._check_shape(name, getattr(self, name), shape)
        if (self.plain_s is None) != (self.plain_spread_s is None):
            raise ValueError("cost model: plain_s and plain_spread_s must be given together")
        if self.plain_s is not None:
            self._check_shape("plain_s", self.plain_s, (C, R))
            self._check_shape("plain_spread_s", self.plain_spread_s, (C, R))
            for c in range(C):
                for r in range(R):
                    v, vs = self.plain_s[c][r], self.plain_spread_s[c][r]
                    if not _finite(v) or v <= 0 or not _finite(vs) or vs < 0:
                        raise ValueError(f"cost model: plain_s[{c}][{r}] (context {self.context_lengths[c]}, rows "
                                         f"{self.rows[r]}) must be finite and > 0 with a spread >= 0, got {v!r}, {vs!r}")
        if (self.overhead_s is None) != (self.overhead_spread_s is None):
            raise ValueError("cost model: overhead_s and overhead_spread_s must be given together")
        if self.overhead_s is not None:
            self._check_shape("overhead_s", self.overhead_s, (2, R))
            self._check_shape("overhead_spread_s", self.overhead_spread_s, (2, R))
            for k, kind in enumerate(OVERHEAD_KINDS):
                for r in range(R):
                    v, vs = self.overhead_s[k][r], self.overhead_spread_s[k][r]
                    if not _finite(v) or not _finite(vs) or vs < 0:
                        raise ValueError(f"cost model: overhead_s[{k}][{r}] ({kind} round, rows {self.rows[r]}) must be "
                                         f"finite with a finite spread >= 0, got {v!r} and {vs!r}")
        if (self.draft_overhead_s is None) != (self.draft_overhead_spread_s is None):
            raise ValueError("cost model: draft_overhead_s and draft_overhead_spread_s must be given together")
        if self.draft_overhead_s is not None:
            if self.overhead_s is None:
                raise ValueError("cost model: draft_overhead_s refines overhead_s, which is missing")
            self._check_shape("draft_overhead_s", self.draft_overhead_s, (R, T))
            self._check_shape("draft_overhead_spread_s", self.draft_overhead_spread_s, (R, T))
            for r in range(R):
                for t in range(T):
                    v, vs = self.draft_overhead_s[r][t], self.draft_overhead_spread_s[r][t]
                    at = f"draft_overhead_s[{r}][{t}] (rows {self.rows[r]}, B {self.batch_tokens[t]})"
                    if (v is None) != (vs is None):
                        raise ValueError(f"cost model: {at} and its spread must be measured together, got {v!r} "
                                         f"and {vs!r}")
                    if v is not None and (not _finite(v) or not _finite(vs) or vs < 0):
                        raise ValueError(f"cost model: {at} must be finite with a finite spread >= 0, got {v!r} "
                                         f"and {vs!r}")
        for c, L in enumerate(self.context_lengths):
            for r, rows in enumerate(self.rows):
                d, ds = self.draft_s[c][r], self.draft_spread_s[c][r]
                if not _finite(d) or d < 0 or not _finite(ds) or ds < 0:
                    raise ValueError(f"cost model: draft_s[{c}][{r}] (context {L}, rows {rows}) and its spread must "
                                     f"be finite and >= 0, got {d!r} and {ds!r}")
                for t, b in enumerate(self.batch_tokens):
                    v, vs = self.verify_s[c][r][t], self.verify_spread_s[c][r][t]
                    at = f"verify_s[{c}][{r}][{t}] (context {L}, rows {rows}, B {b})"
                    if v is None:
                        if vs is not None:
                            raise ValueError(f"cost model: {at} is not measured but has a spread {vs!r}")
                        continue
                    if not _finite(v) or v <= 0:
                        raise ValueError(f"cost model: {at} must be finite and > 0 (or null), got {v!r}")
                    if not _finite(vs) or vs < 0:
                        raise ValueError(f"cost model: spread of {at} must be finite and >= 0, got {vs!r}")
            if self.verify_s[c][-1][-1] is None:
                raise ValueError(
                    f"cost model: verify_s[{c}][{R - 1}][{T - 1}] (context {L}, rows {self.rows[-1]}, "
                    f"B {self.batch_tokens[-1]}) must be measured: the largest row count at the largest batch "
                    f"is where missing cells are filled from"
                )
        if self.overhead_s is not None:  # a negative correction may not make any round free
            fastest = self.fastest_round_s()
            for k, kind in enumerate(OVERHEAD_KINDS):
                for r in range(R):
                    if not fastest[k, r] + self.overhead_s[k][r] > 0:
                        raise ValueError(f"cost model: overhead_s[{k}][{r}] ({kind} round, rows {self.rows[r]}) = "
                                         f"{self.overhead_s[k][r]!r} makes a round free: the fastest {kind} round at "
                                         f"this row count takes {fastest[k, r]!r} s before it")
        if self.draft_overhead_s is not None:
            rounds = self.drafting_rounds_s()  # [C, R, T]
            over = self.draft_overhead_table()
            for r in range(R):
                for t in range(T):
                    if self.draft_overhead_s[r][t] is not None and not rounds[:, r, t].min() + over[r, t] > 0:
                        raise ValueError(f"cost model: draft_overhead_s[{r}][{t}] (rows {self.rows[r]}, B "
                                         f"{self.batch_tokens[t]}) = {float(over[r, t])!r} makes a round free: the "
                                         f"fastest drafting round there takes {float(rounds[:, r, t].min())!r} s "
                                         f"before it")

    @staticmethod
    def _check_shape(name, value, shape, prefix=""):
        if len(value) != shape[0]:
            raise ValueError(f"cost model: {name}{prefix} must have {shape[0]} entries (shape {list(shape)} over "
                             f"contexts, rows, batch tokens), got {len(value)}")
        if len(shape) > 1:
            for i, v in enumerate(value):
                CostModel._check_shape(name, v, shape[1:], f"{prefix}[{i}]")

    # ------------------------------------------------------------------ dense forms
    @property
    def max_tokens(self) -> int:
        return int(self.batch_tokens[-1])

    @property
    def measured(self) -> np.ndarray:
        """bool [C, R, T], True where ``verify_s`` was measured."""
        return np.array([[[v is not None for v in row] for row in ctx] for ctx in self.verify_s])

    def filled_verify(self) -> tuple[np.ndarray, np.ndarray]:
        """Verification seconds and spreads, float64 [C, R, T], with missing cells filled (class docstring)."""
        raw = np.array([[[np.nan if v is None else v for v in row] for row in ctx] for ctx in self.verify_s])
        spread = np.array([[[np.nan if v is None else v for v in row] for row in ctx]
                           for ctx in self.verify_spread_s])
        C, R, T = raw.shape
        for c in range(C):
            for r in range(R - 1, -1, -1):
                nxt = None  # the next measured batch of this row
                for t in range(T - 1, -1, -1):
                    if not np.isnan(raw[c, r, t]):
                        nxt = (c, r, t)
                        continue
                    src = nxt if nxt is not None else (c, r + 1, t)  # r + 1 exists: validate()
                    raw[c, r, t], spread[c, r, t] = raw[src], spread[src]
        return raw, spread

    def verify_cells(self) -> np.ndarray:
        """Verification seconds at every grid cell as the model reads them: the measured (filled) cells
        lowered to their monotone minorant in context, rows and batch (:func:`_monotone_minorant`; timing
        noise only adds time): float64 [C, R, T]."""
        return monotone_minorant(self.filled_verify()[0], (0, 1, 2))

    def verify_grid(self, interpolation: str = "linear") -> np.ndarray:
        """Verification seconds for every batch ``b = 0..max_tokens``: float64 [C, R, N], interpolated
        between :meth:`verify_cells`."""
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation: expected one of {INTERPOLATIONS}, got {interpolation!r}")
        verify = self.verify_cells()
        xs = np.asarray(self.batch_tokens, np.float64)
        b = np.arange(self.max_tokens + 1, dtype=np.float64)
        return np.stack([np.stack([interpolate_step_times(xs, row, b, interpolation) for row in ctx]) for ctx in verify])

    def plain_grid(self) -> np.ndarray:
        """Seconds of a plain round (no drafts) at each context and row count: float64 [C, R]. Measured
        (``plain_s``) where the profile has it, else the verification cell at ``B = rows`` (which lays the
        queries on a ``G + 1`` grid and so overestimates a plain round). Non-decreasing in context and rows
        (:func:`_monotone_minorant`: a cell measured slower than a longer context or more rows is lowered
        to it)."""
        if self.plain_s is not None:
            return monotone_minorant(self.plain_s, (0, 1))
        grid = self.verify_grid("linear")
        return np.stack([[grid[c, r, min(rows, self.max_tokens)] for r, rows in enumerate(self.rows)]
                         for c in range(grid.shape[0])])

    def draft_grid(self) -> np.ndarray:
        """The drafter's seconds at each context and row count, non-decreasing in both (as
        :meth:`plain_grid`): float64 [C, R]."""
        return monotone_minorant(self.draft_s, (0, 1))

    def fastest_round_s(self) -> np.ndarray:
        """The fastest modeled round of each kind at each row count, over every context and batch, before any
        overhead: float64 [2, R] (drafting round: draft + verification, plain round)."""
        return np.stack([self.drafting_rounds_s().min(axis=(0, 2)), self.plain_grid().min(axis=0)])

    def drafting_rounds_s(self) -> np.ndarray:
        """Draft plus verification seconds, before any overhead, at every measured (filled) grid cell, as the
        model reads them (:meth:`verify_cells`, :meth:`draft_grid`): float64 [C, R, T]."""
        return self.verify_cells() + self.draft_grid()[:, :, None]

    def draft_overhead_table(self, spread: bool = False) -> np.ndarray:
        """The drafting round's overhead (or its spread) at each row count and padded batch: float64 [R, T],
        ``draft_overhead_s`` with missing cells filled (class docstring), or ``overhead_s[0]`` broadcast
        over the batches when the profile has no per-batch values (zeros without any overhead)."""
        R, T = len(self.rows), len(self.batch_tokens)
        base = self.overhead_s if not spread else self.overhead_spread_s
        out = np.zeros((R, T)) if base is None else np.repeat(np.asarray(base[0], np.float64)[:, None], T, axis=1)
        cells = self.draft_overhead_s if not spread else self.draft_overhead_spread_s
        if cells is None:
            return out
        for r in range(R):
            have = [t for t in range(T) if cells[r][t] is not None]
            if have:
                out[r] = [cells[r][next((u for u in have if u >= t), have[-1])] for t in range(T)]
        return out

    def without_overhead(self) -> "CostModel":
        """The same cost model with no engine-round overhead (the programs alone)."""
        return dataclasses.replace(self, overhead_s=None, overhead_spread_s=None, draft_overhead_s=None,
                                   draft_overhead_spread_s=None)

    def drafting_grid(self, interpolation: str = "linear") -> np.ndarray:
        """Verification plus the drafting round's overhead for every batch ``b = 0..max_tokens``: float64
        [C, R, N]. The verification cells are read as :meth:`verify_cells` (their monotone minorant in
        context, rows and batch; timing noise only adds time). The overhead, a difference of two
        measured times, is noisy both ways: at each context and row count the sum is then fitted by the
        closest non-decreasing sequence over the batch (least squares, pool adjacent violators), so a round
        that verifies more tokens never costs less and two cells out of order are averaged rather than one
        of them trusted; then interpolated over the batch as :meth:`verify_grid` is."""
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation: expected one of {INTERPOLATIONS}, got {interpolation!r}")
        points = self.verify_cells() + self.draft_overhead_table()[None]  # [C, R, T]
        xs = np.asarray(self.batch_tokens, np.float64)
        b = np.arange(self.max_tokens + 1, dtype=np.float64)
        return np.stack([np.stack([interpolate_step_times(xs, nondecreasing(row), b, interpolation) for row in ctx])
                         for ctx in points])

    def overhead_grid(self) -> np.ndarray:
        """Seconds an engine round takes beyond the profiled programs: float64 [2, R] (drafting round, plain
        round) at each row count; zeros when the profile has none."""
        if self.overhead_s is None:
            return np.zeros((2, len(self.rows)))
        return np.asarray(self.overhead_s, np.float64)

    def plain_step_time(self, num_requests: int, context_tokens: int) -> float:
        """Seconds of a plain round for ``num_requests`` requests (the NumPy twin of :func:`plain_sps_from_cost`)."""
        self.check_query(num_requests, context_tokens)
        r = int(np.searchsorted(np.asarray(self.rows), num_requests, side="left"))
        wv, _ = self.windows_for(context_tokens)
        plain = float(window_mix(np, np.asarray(self.windows, np.float64), self.plain_grid()[:, r], float(wv)))
        return plain + float(self.overhead_grid()[1, r])

    def windows_for(self, context_tokens: int) -> tuple[int, int]:
        """``(verification window, draft window)`` of a round whose longest request holds ``context_tokens``."""
        return round_windows(int(context_tokens), self.block, self.context_step, self.window_rule)

    def curve(self, context_tokens: int, *, tokens_per_request: int = 4) -> dict[str, np.ndarray]:
        """The simple curve at one context: each measured batch ``B`` with :func:`realistic_rows` rows.

        Returns arrays [T]: ``batch_tokens`` and ``rows`` (int64); ``verify_s``, ``draft_s``, ``overhead_s``
        (the drafting round's), ``step_s`` (their sum) and ``spread_s`` (the sum of the spreads, an upper
        bound), float64 seconds.
        """
        verify, vspread = self.filled_verify()
        draft, dspread = np.asarray(self.draft_s, np.float64), np.asarray(self.draft_spread_s, np.float64)
        wv, wd = self.windows_for(context_tokens)
        mix_v = lambda x: float(window_mix(np, np.asarray(self.windows, np.float64), x, float(wv)))
        mix_d = lambda x: float(window_mix(np, np.asarray(self.draft_windows, np.float64), x, float(wd)))
        over, over_spread = self.draft_overhead_table(), self.draft_overhead_table(spread=True)  # [R, T]
        out = {k: [] for k in ("batch_tokens", "rows", "verify_s", "draft_s", "overhead_s", "step_s", "spread_s")}
        for t, b in enumerate(self.batch_tokens):
            rows = realistic_rows(b, max_rows=self.rows[-1], tokens_per_request=tokens_per_request)
            r = int(np.searchsorted(np.asarray(self.rows), rows, side="left"))
            v, d = mix_v(verify[:, r, t]), mix_d(draft[:, r])
            out["batch_tokens"].append(b)
            out["rows"].append(rows)
            out["verify_s"].append(v)
            out["draft_s"].append(d)
            out["overhead_s"].append(float(over[r, t]))
            out["step_s"].append(v + d + float(over[r, t]))
            out["spread_s"].append(mix_v(vspread[:, r, t]) + mix_d(dspread[:, r]) + float(over_spread[r, t]))
        return {k: np.asarray(v) for k, v in out.items()}

    def check_query(self, num_requests, context_tokens) -> None:
        """``ValueError`` unless ``1 <= num_requests <= rows[-1]`` and ``context_tokens >= 0`` (integers)."""
        if not _is_int(num_requests):
            raise ValueError(f"num_requests: expected an integer, got {num_requests!r}")
        if not 1 <= num_requests <= self.rows[-1]:
            raise ValueError(f"num_requests: expected 1..{self.rows[-1]} (the largest profiled row count), got "
                             f"{num_requests}; profile more rows rather than extrapolating")
        if not _is_int(context_tokens) or context_tokens < 0:
            raise ValueError(f"context_tokens: expected an integer >= 0, got {context_tokens!r}")

    def step_times(self, num_requests: int, context_tokens: int, *, interpolation: str = "linear",
                   envelope: bool = False) -> np.ndarray:
        """Round seconds for ``b = 0..max_tokens`` at ``num_requests`` active requests whose longest holds
        ``context_tokens`` tokens: float64 [max_tokens + 1] (the NumPy twin of :func:`sps_from_cost`).
        Non-decreasing in ``b`` (:meth:`drafting_grid`, and a running maximum after the windows are mixed): a
        round that verifies more tokens at the same rows and context never costs less, so measurement noise
        cannot make a larger batch look cheaper."""
        self.check_query(num_requests, context_tokens)
        r = int(np.searchsorted(np.asarray(self.rows), num_requests, side="left"))
        wv, wd = self.windows_for(context_tokens)
        verify = window_mix(np, np.asarray(self.windows, np.float64), self.drafting_grid(interpolation)[:, r, :],
                             float(wv))
        draft = window_mix(np, np.asarray(self.draft_windows, np.float64), self.draft_grid()[:, r], float(wd))
        t = np.maximum.accumulate(verify + draft)
        if envelope:
            t = np.minimum.accumulate(t[::-1])[::-1]
        return t

    def arrays(self, interpolation: str = "linear") -> "CostArrays":
        """The model as device arrays for :func:`sps_from_cost` (build once, reuse every round)."""
        return CostArrays(windows=jnp.asarray(self.windows, jnp.float32),
                          draft_windows=jnp.asarray(self.draft_windows, jnp.float32),
                          rows=jnp.asarray(self.rows, jnp.int32),
                          verify_s=jnp.asarray(self.drafting_grid(interpolation), jnp.float32),
                          draft_s=jnp.asarray(self.draft_grid(), jnp.float32),
                          plain_s=jnp.asarray(self.plain_grid(), jnp.float32),
                          plain_overhead_s=jnp.asarray(self.overhead_grid()[1], jnp.float32),
                          block=int(self.block), context_step=int(self.context_step), window_rule=self.window_rule)

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> dict[str, Any]:
        return {f.name: json.loads(json.dumps(getattr(self, f.name))) for f in dataclasses.fields(self)
                if not (f.name in self._OPTIONAL and getattr(self, f.name) is None)}

    @classmethod
    def from_json(cls, obj: Any, *, source: str = "cost model") -> "CostModel":
        if not isinstance(obj, dict):
            raise ValueError(f"{source}: expected 'cost_model' to be an object, got {type(obj).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing, unknown = set(names) - set(obj) - set(cls._OPTIONAL), set(obj) - set(names)
        if missing or unknown:
            raise ValueError(f"{source}: cost_model fields: missing {sorted(missing)}, unknown {sorted(unknown)}; "
                             f"expected {names}")
        try:
            return cls(**obj)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
