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

__all__ = ["Timing", "time_call", "device_info", "write_json", "format_table", "compile_count"]

_COMPILES = [0]


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """XLA backend compilations so far in this process (differences tell whether a block compiled)."""
    return _COMPILES[0]


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
