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
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SPSPoint", "SPSMetadata", "SPSTable", "INTERPOLATIONS", "atomic_write_text"]

FORMAT = "dspark-sps"
VERSION = 1
INTERPOLATIONS = ("linear", "ceil")


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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"cannot write {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write {path}: folder {folder} is not writable")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclasses.dataclass(frozen=True)
class SPSTable:
    """Measured steps/s against batch tokens, with metadata. Validated on construction."""

    points: tuple[SPSPoint, ...]
    metadata: SPSMetadata = dataclasses.field(default_factory=SPSMetadata)

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
        if interpolation == "linear":
            t = np.interp(b, xs, ts)  # constant below the first point
        else:
            t = ts[np.minimum(np.searchsorted(xs, b, side="left"), len(xs) - 1)]
        return t  # non-decreasing when ``envelope``: both interpolations keep the order of the points

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
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "metadata": dataclasses.asdict(self.metadata),
            "points": [dataclasses.asdict(p) for p in self.points],
        }

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
        try:
            return cls(tuple(points), SPSMetadata(**meta))
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

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
                         backend: str | None = None, device_kind: str | None = None) -> list[str]:
        """Warn (and return the messages) where the table was measured for something else."""
        msgs = []
        for name, want in (("model", model), ("dtype", dtype), ("backend", backend), ("device_kind", device_kind)):
            have = getattr(self.metadata, name)
            if want is not None and have not in ("unknown", want):
                msgs.append(f"SPS table was measured with {name}={have!r} but is used with {name}={want!r}")
        for m in msgs:
            warnings.warn(m, stacklevel=2)
        return msgs
