"""SPS table files: the measured points and their metadata, validation, JSON written atomically, and the
choice of a packaged table for this host."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dspark_jax.io import atomic_write_text
from dspark_jax.sps.cost_model import INTERPOLATIONS, CostModel, interpolate_step_times
from dspark_jax.sps.dense import CostArrays
from dspark_jax.sps.host import CPU_MATCH, cpu_similarity, host_cpu

__all__ = ["FORMAT", "VERSION", "PACKAGED_TABLES", "DEFAULT_TABLE", "SPSPoint", "SPSMetadata", "SPSTable",
           "load_sps_table", "packaged_tables", "select_packaged_table", "default_sps_table"]

FORMAT = "dspark-sps"
VERSION = 1
# The packaged tables, measured for SmolLM2-135M on the CPUs of docs/benchmarks/: default_sps_table() picks
# the one measured on the CPU most like this one, DEFAULT_TABLE where none is alike.
PACKAGED_TABLES = "assets/sps"
DEFAULT_TABLE = "assets/sps/cpu_smollm2_135m.json"
# The drafter fields a profiled table records (``metadata.extra["drafter"]``): what sets a draft program's cost.
DRAFTER_SHAPE_FIELDS = ("n_layers", "ffn_dim", "rank", "draft_vocab_size", "head")


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
        return interpolate_step_times(xs, ts, b, interpolation)  # non-decreasing when ``envelope``: both
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
    def metadata_mismatches(self, *, model: str | None = None, dtype: str | None = None,
                            backend: str | None = None, device_kind: str | None = None
                            ) -> list[tuple[str, str, str]]:
        """``(field, measured, given)`` for each given value the table's metadata records otherwise (``None``
        skips a field; a field the table records as ``"unknown"`` matches anything)."""
        out = []
        for name, want in (("model", model), ("dtype", dtype), ("backend", backend), ("device_kind", device_kind)):
            have = getattr(self.metadata, name)
            if want is not None and have not in ("unknown", want):
                out.append((name, have, want))
        return out

    def check_compatible(self, *, model: str | None = None, dtype: str | None = None,
                         backend: str | None = None, device_kind: str | None = None,
                         block: int | None = None, drafter: dict[str, Any] | None = None) -> list[str]:
        """Warn (and return the messages) where the table was measured for something else.

        ``block`` (G) is compared with the cost model's: verification with another block size compiles
        another shape (``G + 1`` tokens per request) and costs something else. ``drafter`` (a drafter config's
        fields, e.g. ``DrafterConfig.to_dict()``) is compared on :data:`DRAFTER_SHAPE_FIELDS` with the drafter
        the table was profiled with, where it records one: a deeper or wider drafter makes every drafting
        round dearer than the table says.
        """
        msgs = [f"SPS table was measured with {name}={have!r} but is used with {name}={want!r}"
                for name, have, want in self.metadata_mismatches(model=model, dtype=dtype, backend=backend,
                                                                 device_kind=device_kind)]
        if block is not None and self.cost_model is not None and self.cost_model.block != block:
            msgs.append(f"SPS table was measured with block={self.cost_model.block} but is used with block={block}")
        have = self.metadata.extra.get("drafter")
        if drafter is not None and isinstance(have, dict):
            differ = [k for k in DRAFTER_SHAPE_FIELDS if k in have and k in drafter and have[k] != drafter[k]]
            if differ:
                measured = ", ".join(f"{k}={have[k]!r}" for k in differ)
                used = ", ".join(f"{k}={drafter[k]!r}" for k in differ)
                msgs.append(f"SPS table was measured with a drafter of {measured} but is used with one of "
                            f"{used}: its drafting rounds are mispriced until the engine has timed its own "
                            f"(GateConfig.calibrate_times); profile a table with this drafter "
                            f"(python -m profiling.profile_sps --draft ...)")
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


def packaged_tables() -> list[tuple[str, dict]]:
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
    tables = packaged_tables() if tables is None else tables
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
    if score >= dict(CPU_MATCH)["isa"]:
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
