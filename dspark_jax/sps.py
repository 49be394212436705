"""Steps-per-second (SPS) tables: measured target step rates against verification batch size.

A table holds measured points (batch tokens B -> steps/s, with spread) and metadata about where they
were measured. The scheduler indexes a dense float32 array ``sps[b]`` for ``b = 0..N-1``; this module
turns the sparse measurements into that array:

* ``interpolation="linear"`` (default): step time (1 / steps/s) is interpolated linearly between
  measured points; below the first point the first point's step time is used.
* ``interpolation="ceil"``: a batch of ``b`` tokens costs what the next measured batch ``>= b`` costs.
  This is exact for an engine that pads batches to buckets, when the measured points are the buckets.
* ``envelope=True``: replace step time by its suffix minimum, ``t(b) = min_{b' >= b} t(b')``. A batch
  can always be padded to a larger one, so a smaller batch never needs to be slower; the result is a
  non-decreasing step time (non-increasing SPS), free of measurement jitter that would otherwise make
  the scheduler's path jagged.

The dense table ends at the largest measured batch: larger batches are infeasible for the scheduler.

The points are the simple case, one curve ``SPS(B)``. A table may also hold a :class:`CostModel`, the
cost of a whole round measured on a grid (spec section 3, "Cost model")::

    step_time(R, B, L) = draft(R, Wd(L)) + verify(R, bucket(B), Wv(L)) + overhead(drafting, R, B)
    plain_time(R, L) = plain(R, Wv(L)) + overhead(plain, R)      (a round without the drafter)

with ``R`` the active requests (charged at the smallest measured row count ``>= R``, the engine's row
bucket), ``B`` the verification tokens, ``L`` the longest context held by a request, and the attention
windows the engine compiles: ``Wv(L) = window(L + G + 1)`` for verification (the context and up to
``G + 1`` new tokens) and ``Wd(L) = window(L)`` for the drafter, where ``window(n)`` is the smallest power
of two ``>= max(n, 128)`` (rule ``"pow2"``, ``dspark_jax.engine``) or ``n`` rounded up to a multiple of
128 (rule ``"step"``, ``llama.context_bucket``); see :func:`context_window`. Between measured windows
each part is linear in its window (attention reads ``R x W`` positions); beyond the largest it is
extrapolated along the last segment (never downwards), below the smallest it is clamped.
:meth:`SPSTable.sps_for` gives the dense array for one ``(R, L)``; :func:`sps_from_cost` is the same
inside ``jit`` with ``R`` and ``L`` as arrays, so an engine rebuilds the table every round without
compiling again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.resources
import json
import math
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "SPSPoint",
    "SPSMetadata",
    "SPSTable",
    "CostModel",
    "CostArrays",
    "OVERHEAD_KINDS",
    "INTERPOLATIONS",
    "DEFAULT_TABLE",
    "PACKAGED_TABLES",
    "host_cpu",
    "select_packaged_table",
    "atomic_write_text",
    "check_writable",
    "WINDOW_RULES",
    "context_window",
    "round_windows",
    "realistic_rows",
    "sps_from_cost",
    "load_sps_table",
    "default_sps_table",
]

FORMAT = "dspark-sps"
VERSION = 1
INTERPOLATIONS = ("linear", "ceil")
# The packaged tables, measured for SmolLM2-135M on the CPUs the README names ("SPS profiling (measured)"):
# default_sps_table() picks the one measured on the CPU most like this one, DEFAULT_TABLE where none is alike.
PACKAGED_TABLES = "assets/sps"
DEFAULT_TABLE = "assets/sps/cpu_smollm2_135m.json"


def _interpolate(xs: np.ndarray, ts: np.ndarray, b: np.ndarray, interpolation: str) -> np.ndarray:
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


WINDOW_RULES = ("pow2", "step")


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


@dataclasses.dataclass(frozen=True)
class SPSPoint:
    """One measured point: ``steps_per_s`` (median) at ``batch_tokens``, ``spread`` = half the
    interquartile range of steps/s over the repeats (0 for synthetic points)."""

    batch_tokens: int
    steps_per_s: float
    spread: float = 0.0


@dataclasses.dataclass(frozen=True)
class SPSMetadata:
    """Where and how a table was measured. ``extra`` holds anything else (JSON values)."""

    device_kind: str = "unknown"
    backend: str = "unknown"
    model: str = "unknown"
    dtype: str = "unknown"
    context_length: int = 0
    date: str = ""
    extra: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def today() -> str:
        return datetime.date.today().isoformat()


def check_writable(path: str | os.PathLike) -> Path:
    """Raise ``ValueError`` unless a file can be written at ``path`` (call it before long work)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"cannot write {path}: folder {folder} does not exist")
    if path.is_dir():
        raise ValueError(f"cannot write {path}: it is a folder")
    # A real probe: os.access says yes to root on a read-only file system, and a long job would then fail
    # at its first save.
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        raise ValueError(f"cannot write {path}: folder {folder} is not writable ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    path = check_writable(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be read by others
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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


def _nondecreasing(y: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit of ``y`` [T] (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in np.asarray(y, np.float64):
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return np.concatenate([np.full(int(n), total / n) for total, n in blocks])


def _monotone_minorant(y, axes) -> np.ndarray:
    """The greatest array below ``y`` that is non-decreasing along each of ``axes``: a suffix minimum along
    each axis in turn (a suffix minimum along one axis keeps the array non-decreasing along the others).

    Timing noise on a shared host only ever adds time, so where two measured cells are out of order (a longer
    context, more rows or more tokens measured faster) the faster one is the better estimate of both: the
    slower cell is lowered to it, the faster one is kept."""
    out = np.asarray(y, np.float64)
    for axis in axes:
        out = np.flip(np.minimum.accumulate(np.flip(out, axis), axis=axis), axis)
    return out


def _window_mix(xp, windows, per_ctx, w):
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
    the engine (``profiling.profile_round_overhead``); it is added to every round time of its kind.
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
        return _monotone_minorant(self.filled_verify()[0], (0, 1, 2))

    def verify_grid(self, interpolation: str = "linear") -> np.ndarray:
        """Verification seconds for every batch ``b = 0..max_tokens``: float64 [C, R, N], interpolated
        between :meth:`verify_cells`."""
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation: expected one of {INTERPOLATIONS}, got {interpolation!r}")
        verify = self.verify_cells()
        xs = np.asarray(self.batch_tokens, np.float64)
        b = np.arange(self.max_tokens + 1, dtype=np.float64)
        return np.stack([np.stack([_interpolate(xs, row, b, interpolation) for row in ctx]) for ctx in verify])

    def plain_grid(self) -> np.ndarray:
        """Seconds of a plain round (no drafts) at each context and row count: float64 [C, R]. Measured
        (``plain_s``) where the profile has it, else the verification cell at ``B = rows`` (which lays the
        queries on a ``G + 1`` grid and so overestimates a plain round). Non-decreasing in context and rows
        (:func:`_monotone_minorant`: a cell measured slower than a longer context or more rows is lowered
        to it)."""
        if self.plain_s is not None:
            return _monotone_minorant(self.plain_s, (0, 1))
        grid = self.verify_grid("linear")
        return np.stack([[grid[c, r, min(rows, self.max_tokens)] for r, rows in enumerate(self.rows)]
                         for c in range(grid.shape[0])])

    def draft_grid(self) -> np.ndarray:
        """The drafter's seconds at each context and row count, non-decreasing in both (as
        :meth:`plain_grid`): float64 [C, R]."""
        return _monotone_minorant(self.draft_s, (0, 1))

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
        return np.stack([np.stack([_interpolate(xs, _nondecreasing(row), b, interpolation) for row in ctx])
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
        plain = float(_window_mix(np, np.asarray(self.windows, np.float64), self.plain_grid()[:, r], float(wv)))
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
        mix_v = lambda x: float(_window_mix(np, np.asarray(self.windows, np.float64), x, float(wv)))
        mix_d = lambda x: float(_window_mix(np, np.asarray(self.draft_windows, np.float64), x, float(wd)))
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
        verify = _window_mix(np, np.asarray(self.windows, np.float64), self.drafting_grid(interpolation)[:, r, :],
                             float(wv))
        draft = _window_mix(np, np.asarray(self.draft_windows, np.float64), self.draft_grid()[:, r], float(wd))
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
    verify = _window_mix(jnp, cost.windows, cost.verify_s[:, r, :], wv.astype(jnp.float32))  # [N]
    draft = _window_mix(jnp, cost.draft_windows, cost.draft_s[:, r], wd.astype(jnp.float32))  # []
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
    plain = _window_mix(jnp, cost.windows, cost.plain_s[:, r], wv.astype(jnp.float32)) + cost.plain_overhead_s[r]
    return (1.0 / plain).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SPSTable:
    """Measured steps/s against batch tokens, with metadata. Validated on construction.

    ``cost_model`` (optional) is the grid the points were derived from, see :class:`CostModel`; tables
    written before it existed load with ``cost_model=None``.

    Timings measured in one's own engine become a table with :meth:`from_arrays` (steps per second of the
    target at each verified batch size); :meth:`to_dense` gives the scheduler's float32 [N] array
    (``sps[b]`` for a batch of ``b`` tokens, linear in step time between the points):

    >>> table = SPSTable.from_arrays(batch_tokens=[1, 8, 16], steps_per_s=[100.0, 80.0, 40.0])
    >>> table.to_dense().shape, round(float(table.to_dense()[8]), 1)
    ((17,), 80.0)
    """

    points: tuple[SPSPoint, ...]
    metadata: SPSMetadata = dataclasses.field(default_factory=SPSMetadata)
    cost_model: CostModel | None = None

    def __post_init__(self):
        object.__setattr__(self, "points", tuple(self.points))
        self.validate()

    # ------------------------------------------------------------------ construction / validation
    @classmethod
    def from_arrays(cls, batch_tokens, steps_per_s, spread=None, metadata: SPSMetadata | None = None):
        """Build a table from parallel sequences (sorted by batch size here)."""
        b = [int(x) for x in np.asarray(batch_tokens).reshape(-1)]
        s = [float(x) for x in np.asarray(steps_per_s, dtype=np.float64).reshape(-1)]
        d = [0.0] * len(b) if spread is None else [float(x) for x in np.asarray(spread).reshape(-1)]
        if not (len(b) == len(s) == len(d)):
            raise ValueError(
                f"SPS table: batch_tokens, steps_per_s and spread must have equal lengths, "
                f"got {len(b)}, {len(s)}, {len(d)}"
            )
        order = sorted(range(len(b)), key=lambda i: b[i])
        pts = tuple(SPSPoint(b[i], s[i], d[i]) for i in order)
        return cls(pts, metadata or SPSMetadata())

    def validate(self) -> None:
        if not self.points:
            raise ValueError("SPS table: expected at least one measured point, got none")
        prev = 0
        for i, p in enumerate(self.points):
            if not isinstance(p.batch_tokens, (int, np.integer)) or p.batch_tokens < 1:
                raise ValueError(f"SPS table point {i}: batch_tokens must be an integer >= 1, got {p.batch_tokens!r}")
            if p.batch_tokens <= prev:
                raise ValueError(
                    f"SPS table point {i}: batch_tokens must be strictly increasing, got {p.batch_tokens} "
                    f"after {prev}"
                )
            prev = p.batch_tokens
            if not (math.isfinite(p.steps_per_s) and p.steps_per_s > 0):
                raise ValueError(
                    f"SPS table point {i} (B={p.batch_tokens}): steps_per_s must be finite and > 0, "
                    f"got {p.steps_per_s!r}"
                )
            if not (math.isfinite(p.spread) and p.spread >= 0):
                raise ValueError(
                    f"SPS table point {i} (B={p.batch_tokens}): spread must be finite and >= 0, got {p.spread!r}"
                )

    # ------------------------------------------------------------------ accessors
    @property
    def batch_tokens(self) -> np.ndarray:
        return np.array([p.batch_tokens for p in self.points], dtype=np.int64)

    @property
    def steps_per_s(self) -> np.ndarray:
        return np.array([p.steps_per_s for p in self.points], dtype=np.float64)

    @property
    def spread(self) -> np.ndarray:
        return np.array([p.spread for p in self.points], dtype=np.float64)

    @property
    def max_tokens(self) -> int:
        return int(self.points[-1].batch_tokens)

    # ------------------------------------------------------------------ dense array for the scheduler
    def step_times(self, max_tokens: int | None = None, *, interpolation: str = "linear",
                   envelope: bool = False) -> np.ndarray:
        """Step time in seconds for ``b = 0..max_tokens`` (float64 [max_tokens + 1])."""
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation: expected one of {INTERPOLATIONS}, got {interpolation!r}")
        top = self.max_tokens if max_tokens is None else int(max_tokens)
        if top < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {top}")
        if top > self.max_tokens:
            raise ValueError(
                f"max_tokens={top} exceeds the largest measured batch ({self.max_tokens} tokens); "
                f"profile larger batches instead of extrapolating"
            )
        xs = self.batch_tokens.astype(np.float64)
        ts = 1.0 / self.steps_per_s
        b = np.arange(top + 1, dtype=np.float64)
        if envelope:
            ts = np.minimum.accumulate(ts[::-1])[::-1]
        return _interpolate(xs, ts, b, interpolation)  # non-decreasing when ``envelope``: both
        # interpolations keep the order of the points

    def to_dense(self, max_tokens: int | None = None, *, interpolation: str = "linear",
                 envelope: bool = False) -> np.ndarray:
        """The scheduler's table: float32 [N] with ``N = max_tokens + 1`` and ``sps[b]`` steps/s.

        Args:
          max_tokens: last batch size in the table (default: the largest measured one). Larger
            values than measured are rejected rather than extrapolated.
          interpolation: "linear" (step time between points) or "ceil" (next measured point).
          envelope: use the monotone envelope (non-increasing steps/s), see the module docstring.
        """
        return (1.0 / self.step_times(max_tokens, interpolation=interpolation, envelope=envelope)).astype(
            np.float32
        )

    # ------------------------------------------------------------------ serialisation
    # ------------------------------------------------------------------ cost model (R, B, L)
    def _require_cost_model(self) -> CostModel:
        if self.cost_model is None:
            raise ValueError("this SPS table has no cost model (only the SPS(B) points): use to_dense(), or "
                             "profile again with python -m profiling.profile_sps")
        return self.cost_model

    def sps_for(self, num_requests: int, context_tokens: int, *, interpolation: str = "linear",
                envelope: bool = False) -> np.ndarray:
        """The scheduler's table for one round's load: float32 [N], ``N = cost_model.max_tokens + 1``.

        ``sps[b] = 1 / (draft(R, L) + verify(R, b, L))`` with ``R = num_requests`` active requests and
        ``L = context_tokens`` held by the longest one (module docstring). Raises ``ValueError`` when the
        table has no cost model or the load lies outside what can be read from it.
        """
        cm = self._require_cost_model()
        t = cm.step_times(num_requests, context_tokens, interpolation=interpolation, envelope=envelope)
        return (1.0 / t).astype(np.float32)

    def cost_arrays(self, *, interpolation: str = "linear") -> CostArrays:
        """Device arrays of the cost model for :func:`sps_from_cost` (inside ``jit``)."""
        return self._require_cost_model().arrays(interpolation)

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            "version": VERSION,
            "metadata": dataclasses.asdict(self.metadata),
            "points": [dataclasses.asdict(p) for p in self.points],
        }
        if self.cost_model is not None:
            out["cost_model"] = self.cost_model.to_json()
        return out

    @classmethod
    def from_json(cls, obj: Any, *, source: str = "SPS table") -> "SPSTable":
        if not isinstance(obj, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(obj).__name__}")
        if obj.get("format") != FORMAT:
            raise ValueError(f"{source}: expected format {FORMAT!r}, got {obj.get('format')!r}")
        if obj.get("version") != VERSION:
            raise ValueError(f"{source}: expected version {VERSION}, got {obj.get('version')!r}")
        raw_points = obj.get("points")
        if not isinstance(raw_points, list):
            raise ValueError(f"{source}: expected 'points' to be a list, got {type(raw_points).__name__}")
        points = []
        for i, p in enumerate(raw_points):
            if not isinstance(p, dict) or "batch_tokens" not in p or "steps_per_s" not in p:
                raise ValueError(f"{source}: point {i} needs 'batch_tokens' and 'steps_per_s', got {p!r}")
            b = p["batch_tokens"]
            if not isinstance(b, int) or isinstance(b, bool):
                raise ValueError(f"{source}: point {i}: batch_tokens must be an integer, got {b!r}")
            try:
                points.append(SPSPoint(b, float(p["steps_per_s"]), float(p.get("spread", 0.0))))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: point {i}: {e}") from None
        meta = obj.get("metadata", {})
        if not isinstance(meta, dict):
            raise ValueError(f"{source}: expected 'metadata' to be an object, got {type(meta).__name__}")
        known = {f.name for f in dataclasses.fields(SPSMetadata)}
        unknown = set(meta) - known
        if unknown:
            raise ValueError(f"{source}: unknown metadata fields {sorted(unknown)}; expected {sorted(known)}")
        cost = obj.get("cost_model")
        cost = None if cost is None else CostModel.from_json(cost, source=source)
        try:
            table = cls(tuple(points), SPSMetadata(**meta), cost)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        if cost is not None and table.max_tokens != cost.max_tokens:
            raise ValueError(f"{source}: the points end at B={table.max_tokens} but the cost model at "
                             f"B={cost.max_tokens}")
        return table

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as JSON, atomically."""
        atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SPSTable":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"SPS table {path}: file not found")
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"SPS table {path}: not valid JSON ({e})") from None
        return cls.from_json(obj, source=f"SPS table {path}")

    # ------------------------------------------------------------------ compatibility
    def check_compatible(self, *, model: str | None = None, dtype: str | None = None,
                         backend: str | None = None, device_kind: str | None = None,
                         block: int | None = None) -> list[str]:
        """Warn (and return the messages) where the table was measured for something else.

        ``block`` (G) is compared with the cost model's: verification with another block size compiles
        another shape (``G + 1`` tokens per request) and costs something else.
        """
        msgs = []
        for name, want in (("model", model), ("dtype", dtype), ("backend", backend), ("device_kind", device_kind)):
            have = getattr(self.metadata, name)
            if want is not None and have not in ("unknown", want):
                msgs.append(f"SPS table was measured with {name}={have!r} but is used with {name}={want!r}")
        if block is not None and self.cost_model is not None and self.cost_model.block != block:
            msgs.append(f"SPS table was measured with block={self.cost_model.block} but is used with block={block}")
        for m in msgs:
            warnings.warn(m, stacklevel=2)
        return msgs


def load_sps_table(path: str | os.PathLike, *, model: str | None = None, dtype: str | None = None,
                   backend: str | None = None, device_kind: str | None = None,
                   block: int | None = None) -> SPSTable:
    """Load a table and warn (``UserWarning``, :meth:`SPSTable.check_compatible`) where its metadata does
    not match what it is about to be used with; ``None`` skips a check. Never silently mixes: the
    warnings name both values.

    >>> load_sps_table("no/such/table.json")
    Traceback (most recent call last):
    ...
    ValueError: ...no/such/table.json...
    """
    table = SPSTable.load(path)
    table.check_compatible(model=model, dtype=dtype, backend=backend, device_kind=device_kind, block=block)
    return table


# What a CPU's steps per second depend on most, in the order they count when a packaged table is matched to
# this host: the same widest vector unit (a table of another one is never preferred: under a hypervisor the
# model name is often generic, "AMD EPYC" for an AVX2 and an AVX-512 generation alike), the same family and
# model numbers (the generation), the same model name, the same vendor, the same core count. Each weight
# exceeds the sum of those after it.
_CPU_MATCH = (("isa", 16), ("family", 8), ("model_name", 4), ("vendor", 2), ("cores", 1))


def host_cpu() -> dict[str, Any]:
    """The CPU this process runs on, as far as its steps per second depend on it: ``vendor``, ``model_name``,
    ``family`` (x86 ``"cpu family/model"``, e.g. ``"25/17"`` for AMD Zen 4; ``""`` where unknown), ``isa``
    (the widest vector unit: ``amx``, ``avx512``, ``avx2``, ``sve``, ``neon`` or ``""``), ``cores`` and
    ``machine``. Read from ``/proc/cpuinfo`` on Linux, from :mod:`platform` elsewhere. The profiler records it
    in every table (``metadata.extra["cpu"]``) and :func:`default_sps_table` matches it. Under a hypervisor
    the model name can be generic ("Intel(R) Xeon(R) Processor", "AMD EPYC"); the instruction set and the
    family and model numbers still tell the generations apart."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    isa = next((name for name, flag in (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2"),
                                        ("sve", "sve"), ("neon", "asimd")) if flag in flags), "")
    family = f"{fields['cpu family']}/{fields['model']}" if "cpu family" in fields and "model" in fields else ""
    return {"vendor": fields.get("vendor_id", ""), "model_name": fields.get("model name", platform.processor()),
            "family": family, "isa": isa, "cores": os.cpu_count() or 0, "machine": platform.machine()}


def cpu_similarity(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How alike two :func:`host_cpu` records are (:data:`_CPU_MATCH` weights of the fields that are known
    and equal in both; the machine must agree, else 0)."""
    if a.get("machine") != b.get("machine"):
        return 0
    return sum(w for key, w in _CPU_MATCH if a.get(key) not in (None, "", 0) and a.get(key) == b.get(key))


def _packaged_tables() -> list[tuple[str, dict]]:
    """(resource name, metadata) of every packaged table, :data:`DEFAULT_TABLE` first."""
    folder = importlib.resources.files("dspark_jax").joinpath(PACKAGED_TABLES)
    names = [f"{PACKAGED_TABLES}/{f.name}" for f in folder.iterdir() if f.name.endswith(".json")] \
        if folder.is_dir() else []
    out = []
    for name in sorted(names, key=lambda n: (n != DEFAULT_TABLE, n)):
        try:
            meta = json.loads(importlib.resources.files("dspark_jax").joinpath(name).read_text())["metadata"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the packaged SPS table {name} is not a table ({e})") from None
        out.append((name, meta))
    return out


def select_packaged_table(backend: str | None = None, device_kind: str | None = None,
                          cpu: dict[str, Any] | None = None,
                          tables: list[tuple[str, dict]] | None = None) -> tuple[str, str | None]:
    """The packaged table for this host: ``(resource name, warning or None)``.

    On an accelerator, a table of the same backend and device kind, else :data:`DEFAULT_TABLE` with a
    warning (profile one: a table measured on other hardware misprices every round). On a CPU, the table
    whose recorded CPU (``metadata.extra["cpu"]``) is most like this one (:func:`cpu_similarity`; ties keep
    :data:`DEFAULT_TABLE`, then file order), with a warning when none shares at least its vector unit.
    ``tables``: (name, metadata) pairs to choose from (default: the packaged ones, :data:`DEFAULT_TABLE`
    first); ``cpu``: a :func:`host_cpu` record (default: this host's)."""
    backend = backend or jax.default_backend()
    device_kind = device_kind or jax.devices(backend)[0].device_kind
    tables = _packaged_tables() if tables is None else tables
    if not any(name == DEFAULT_TABLE for name, _ in tables):
        raise ValueError(f"the packaged SPS table {DEFAULT_TABLE} is missing from this installation; "
                         f"profile one with python -m profiling.profile_sps --out TABLE.json")
    advice = ("profile one with python -m profiling.profile_sps --out TABLE.json and pass it (--sps TABLE.json, "
              "or Engine(..., sps=load_sps_table(path)))")
    if backend != "cpu":
        for name, meta in tables:
            if meta.get("backend") == backend and meta.get("device_kind") == device_kind:
                return name, None
        return DEFAULT_TABLE, (f"no packaged SPS table was measured on {backend} ({device_kind}); using "
                               f"{DEFAULT_TABLE}, measured on a CPU; {advice}")
    cpu = host_cpu() if cpu is None else cpu
    scored = [(cpu_similarity(cpu, meta.get("extra", {}).get("cpu") or {}), -i, name)
              for i, (name, meta) in enumerate(tables) if meta.get("backend") == "cpu"]
    score, _, name = max(scored, default=(0, 0, DEFAULT_TABLE))
    if score >= dict(_CPU_MATCH)["isa"]:
        return name, None
    return name, (f"no packaged SPS table was measured on a CPU like this one ({cpu.get('model_name')!r}, "
                  f"{cpu.get('isa') or 'no known vector unit'}, {cpu.get('cores')} cores); using {name}; {advice}")


def default_sps_table(*, model: str | None = None, dtype: str | None = None, backend: str | None = None,
                      device_kind: str | None = None, block: int | None = None) -> SPSTable:
    """The packaged table for this host (:func:`select_packaged_table`: measured for SmolLM2-135M on the CPU
    most like this one), checked like :func:`load_sps_table`. Used when no table is given. Warns where no
    packaged table was measured on hardware like this."""
    name, warning = select_packaged_table(backend, device_kind)
    if warning:
        warnings.warn(warning, stacklevel=2)
    with importlib.resources.as_file(importlib.resources.files("dspark_jax").joinpath(name)) as path:
        return load_sps_table(path, model=model, dtype=dtype, backend=backend, device_kind=device_kind,
                              block=block)
