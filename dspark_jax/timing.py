"""Timing helpers shared by the benchmarks and the profiler: warm up, exclude compilation, block until
ready, repeat, report the median and the spread."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dspark_jax.io import atomic_write_text

__all__ = ["Timing", "time_call", "interleaved", "device_info", "write_json", "format_table", "compile_count",
           "compile_seconds"]

_COMPILES = [0]
_COMPILE_SECONDS = [0.0]


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1
        _COMPILE_SECONDS[0] += float(duration)


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """XLA backend compilations so far in this process (differences tell whether a block compiled)."""
    return _COMPILES[0]


def compile_seconds() -> float:
    """Seconds XLA spent compiling so far in this process (backend compilation, as jax reports it)."""
    return _COMPILE_SECONDS[0]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: median, 25th and 75th percentiles over ``repeats`` measurements."""

    median: float
    p25: float
    p75: float
    repeats: int

    @property
    def spread(self) -> float:
        """Half the interquartile range, in seconds."""
        return (self.p75 - self.p25) / 2


def time_call(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, inner: int = 1,
              max_seconds: float | None = None) -> Timing:
    """Time ``fn()`` (blocking on its result), ``inner`` calls per measurement.

    The warm-up calls compile and are excluded. ``max_seconds`` stops early (keeping at least three
    measurements) so that slow points do not blow a time budget.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    start = time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
        if max_seconds is not None and i >= 2 and time.perf_counter() - start > max_seconds:
            break
    s = np.asarray(samples)
    return Timing(float(np.median(s)), float(np.percentile(s, 25)), float(np.percentile(s, 75)), len(s))


def interleaved(thunks: dict[Any, Callable[[], Any]], *, repeats: int = 5, warmup: int = 1, burst: int = 1,
                min_seconds: float = 0.0, max_repeats: int | None = None,
                max_seconds: float | None = None) -> dict[Any, Timing]:
    """Time several thunks in turns (a, b, c, a, b, c, ...), blocking on each result.

    Warm-up calls (compilation) are excluded. Taking turns, a host whose speed drifts slows every thunk
    alike, so ratios between them are sound even where absolute times are not. With ``burst`` > 1 each turn
    calls its thunk ``burst`` times and times the last call only: the thunk then runs with its data in the
    caches, as a program the engine runs round after round does, not evicted by the other thunks.

    Args:
        thunks: name -> a function of no arguments returning arrays.
        repeats: timed calls of each thunk (at least 1).
        warmup: untimed calls of each thunk first.
        burst: calls per turn, the last one timed (at least 1).
        min_seconds: go on taking turns past ``repeats`` until the timed calls add up to this many seconds
          (fast programs: a handful of calls of a few milliseconds is mostly the host's jitter) ...
        max_repeats: ... but stop at this many turns (default: ``4 * repeats``).
        max_seconds: stop after the turn that passes this many seconds of timed calls (keeping at least
          ``min(repeats, 3)`` turns), so that slow programs do not blow a time budget.
    Returns:
        name -> `Timing` (median, quartiles) in seconds.

    >>> t = interleaved({"a": lambda: jax.numpy.ones(3), "b": lambda: jax.numpy.zeros(3)}, repeats=3)
    >>> sorted(t), t["a"].repeats
    (['a', 'b'], 3)
    """
    max_repeats = 4 * repeats if max_repeats is None else max_repeats
    if repeats < 1 or warmup < 0 or burst < 1 or min_seconds < 0 or max_repeats < repeats:
        raise ValueError(f"interleaved: repeats >= 1, warmup >= 0, burst >= 1, min_seconds >= 0 and "
                         f"max_repeats >= repeats expected, got {repeats}, {warmup}, {burst}, {min_seconds} and "
                         f"{max_repeats}")
    for fn in thunks.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    samples: dict[Any, list[float]] = {name: [] for name in thunks}
    spent, turns = 0.0, 0
    while turns < repeats or (spent < min_seconds and turns < max_repeats):
        if max_seconds is not None and turns >= min(repeats, 3) and spent > max_seconds:
            break
        for name, fn in thunks.items():
            for _ in range(burst - 1):
                jax.block_until_ready(fn())
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            dt = time.perf_counter() - t0
            samples[name].append(dt)
            spent += dt
        turns += 1
    out = {}
    for name, s in samples.items():
        a = np.asarray(s)
        out[name] = Timing(float(np.median(a)), float(np.percentile(a, 25)), float(np.percentile(a, 75)), len(a))
    return out


def device_info() -> dict[str, str]:
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": str(jax.device_count()),
        "jax_version": jax.__version__,
        "host": f"{platform.machine()} {os.cpu_count()} cores",
    }


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A fixed-width text table of the given columns."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
