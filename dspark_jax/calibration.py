"""Sequential Temperature Scaling (STS) and calibration metrics for the confidence head.

Spec section 4. The scheduler needs calibrated magnitudes: ``a_k = prod_{i<=k} c_i`` should be the
probability that the first k drafts are all accepted. On held-out rounds, for k = 1..G in order, STS picks
a temperature ``T_k`` from a grid (``2^(i/10)``, i = -30..30) that minimises the expected calibration error
of ``prod_{i<=k} sigmoid(logit_i / T_i)`` against the observed event "the first k drafts were all
accepted", keeping ``T_1..T_{k-1}`` fixed.

Axis legend: N rounds, G block positions, P grid points.

Inputs everywhere: ``conf_logits`` float [N, G] (the confidence head's raw logits), ``accepted`` int [N]
(drafts accepted in the round) and ``verified`` int [N] (drafts verified); position k (1-based) is observed
when ``k <= verified`` and its event is ``accepted >= k``.

Beyond the paper, `fit_sts_bias` fits a per-position logit offset ``b_k`` beside each temperature,
``sigmoid(logit_k / T_k + b_k)`` (Platt scaling, fitted by the same sequential grid search): a temperature can
only pull a confidence towards 0.5, so a head that reads too high on both sides of 0.5 (as the head trained on
the temperature-1 acceptance does for greedy requests) needs the offset. ``b = 0`` everywhere is plain STS.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.io import atomic_write_text

__all__ = ["STS_GRID", "STS_BIAS_GRID", "ece", "brier", "auroc", "reliability_bins", "apply_sts",
           "survival_from_logits", "fit_sts", "fit_sts_bias", "events", "calibration_report", "STSSets",
           "sts_for_rows", "save_temperatures", "save_sts", "load_temperatures", "load_sts"]

STS_GRID = tuple(float(2.0 ** (i / 10)) for i in range(-30, 31))
# logit offsets searched by `fit_sts_bias`, smallest magnitude first (ties keep the smaller offset)
STS_BIAS_GRID = tuple(sorted((round(i / 20, 2) for i in range(-60, 61)), key=lambda b: (abs(b), b)))
N_BINS = 20


def events(accepted, verified, block: int):
    """Observed outcomes: (event [N, G] bool "first k accepted", observed [N, G] bool)."""
    k = jnp.arange(1, block + 1)
    accepted, verified = jnp.asarray(accepted), jnp.asarray(verified)
    return accepted[:, None] >= k[None, :], verified[:, None] >= k[None, :]


@functools.partial(jax.jit, static_argnames=("bins",))
def ece(pred, outcome, weight=None, *, bins: int = N_BINS):
    """Expected calibration error: equal-width bins on [0, 1], weighted mean |mean pred - mean outcome|.

    Args:
      pred: float [...] predicted probabilities; outcome: bool/float [...]; weight: optional [...]
        (0 drops an entry).
    Returns:
      float32 [].

    >>> float(ece(jnp.array([0.2, 0.2, 0.8, 0.8]), jnp.array([0., 1., 1., 1.])))
    0.2...
    """
    pred = jnp.ravel(pred).astype(jnp.float32)
    outcome = jnp.ravel(outcome).astype(jnp.float32)
    w = jnp.ones_like(pred) if weight is None else jnp.ravel(weight).astype(jnp.float32)
    idx = jnp.clip(jnp.floor(pred * bins).astype(jnp.int32), 0, bins - 1)
    cnt = jax.ops.segment_sum(w, idx, num_segments=bins)
    sp = jax.ops.segment_sum(w * pred, idx, num_segments=bins)
    so = jax.ops.segment_sum(w * outcome, idx, num_segments=bins)
    return jnp.sum(jnp.abs(sp - so)) / jnp.maximum(jnp.sum(cnt), 1e-12)


@jax.jit
def brier(pred, outcome, weight=None):
    """Weighted mean squared error of probabilities."""
    pred = jnp.ravel(pred).astype(jnp.float32)
    outcome = jnp.ravel(outcome).astype(jnp.float32)
    w = jnp.ones_like(pred) if weight is None else jnp.ravel(weight).astype(jnp.float32)
    return jnp.sum(w * (pred - outcome) ** 2) / jnp.maximum(jnp.sum(w), 1e-12)


def auroc(pred, outcome, weight=None) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); NaN when one class is absent."""
    pred = np.ravel(np.asarray(pred, np.float64))
    outcome = np.ravel(np.asarray(outcome, bool))
    keep = np.ones_like(outcome) if weight is None else np.ravel(np.asarray(weight)) > 0
    pred, outcome = pred[keep], outcome[keep]
    n_pos, n_neg = outcome.sum(), (~outcome).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(pred, kind="stable")
    ranks = np.empty(len(pred))
    sorted_pred = pred[order]
    # average ranks over ties
    uniq, start, counts = np.unique(sorted_pred, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[outcome].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def reliability_bins(pred, outcome, weight=None, bins: int = N_BINS) -> dict[str, list[float]]:
    """Per-bin mean prediction, mean outcome and count (for a reliability diagram)."""
    pred = np.ravel(np.asarray(pred, np.float64))
    outcome = np.ravel(np.asarray(outcome, np.float64))
    w = np.ones_like(pred) if weight is None else np.ravel(np.asarray(weight, np.float64))
    idx = np.clip((pred * bins).astype(int), 0, bins - 1)
    cnt = np.bincount(idx, w, bins)
    sp = np.bincount(idx, w * pred, bins)
    so = np.bincount(idx, w * outcome, bins)
    safe = np.maximum(cnt, 1e-12)
    return {"pred": (sp / safe).tolist(), "obs": (so / safe).tolist(), "count": cnt.tolist()}


@jax.jit
def apply_sts(conf_logits: jax.Array, temperatures: jax.Array, biases: jax.Array | None = None) -> jax.Array:
    """Calibrated per-position confidences ``sigmoid(logit_k / T_k + b_k)``.

    Args:
      conf_logits: float [..., G], the confidence head's raw logits (any float dtype; computed in float32).
      temperatures: float [G] or [..., G] broadcasting against ``conf_logits`` (`fit_sts`, `sts_for_rows`).
      biases: optional float offsets shaped like ``temperatures`` (`fit_sts_bias`; default 0).
    Returns:
      float32 [..., G] confidences in (0, 1).

    >>> [round(float(c), 3) for c in apply_sts(jnp.array([[0.0, 2.0]]), jnp.array([1.0, 2.0]))[0]]
    [0.5, 0.731]
    >>> [round(float(c), 3) for c in apply_sts(jnp.array([[0.0, 2.0]]), jnp.array([1.0, 2.0]),
    ...                                        jnp.array([0.0, -1.0]))[0]]
    [0.5, 0.5]
    """
    for name, x in (("temperatures", temperatures), ("biases", biases)):
        if x is not None and (jnp.ndim(x) == 0 or jnp.shape(x)[-1] != jnp.shape(conf_logits)[-1]):
            raise ValueError(f"{name}: expected [..., G] with G = {jnp.shape(conf_logits)[-1]} (the last axis "
                             f"of conf_logits), got shape {jnp.shape(x)}")
    z = conf_logits.astype(jnp.float32) / temperatures.astype(jnp.float32)
    if biases is not None:
        z = z + biases.astype(jnp.float32)
    return jax.nn.sigmoid(z)


@jax.jit
def survival_from_logits(conf_logits: jax.Array, temperatures: jax.Array, biases: jax.Array | None = None
                         ) -> jax.Array:
    """Predicted survival ``prod_{i<=k} sigmoid(logit_i / T_i + b_i)``: [N, G] -> [N, G]."""
    return jnp.cumprod(apply_sts(conf_logits, temperatures, biases), axis=-1)


@jax.jit
def _fit(conf_logits, event, observed, grid, bias_grid):
    """STS core: a lax.scan over positions, each choosing the (offset, temperature) pair of least ECE among
    the grids' product; candidates run offset-major, so ties keep the first offset, then the first
    temperature of ``grid`` (the caller orders it nearest 1 first)."""
    n, g = conf_logits.shape
    temps_c = jnp.tile(grid, bias_grid.shape[0])  # [Q * P]
    bias_c = jnp.repeat(bias_grid, grid.shape[0])  # [Q * P]

    def step(prefix, k):
        logit_k = conf_logits[:, k]
        w = observed[:, k].astype(jnp.float32)
        e = event[:, k]
        # [Q * P, N] survival at position k for every candidate
        cand = prefix[None, :] * jax.nn.sigmoid(logit_k[None, :] / temps_c[:, None] + bias_c[:, None])
        errs = jax.lax.map(lambda p: ece(p, e, w), cand, batch_size=256)
        best = jnp.argmin(errs)  # first minimum
        return cand[best], (temps_c[best], bias_c[best], errs[best])

    _, (temps, biases, errs) = jax.lax.scan(step, jnp.ones((n,), jnp.float32), jnp.arange(g))
    return temps, biases, errs


def _fit_checked(conf_logits, accepted, verified, grid, bias_grid):
    conf_logits = jnp.asarray(conf_logits, jnp.float32)
    if conf_logits.ndim != 2:
        raise ValueError(f"conf_logits: expected [N, G], got shape {conf_logits.shape}")
    n, g = conf_logits.shape
    acc, ver = np.asarray(accepted), np.asarray(verified)
    for name, x in (("accepted", acc), ("verified", ver)):
        if x.shape != (n,):
            raise ValueError(f"{name}: expected int [N] = [{n}] (one per row of conf_logits), got shape {x.shape}")
    bad = np.flatnonzero((acc < 0) | (acc > ver) | (ver > g))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"round {i}: expected 0 <= accepted <= verified <= G = {g}, got accepted {acc[i]}, "
                         f"verified {ver[i]}")
    finite = np.isfinite(np.asarray(conf_logits)).all(axis=1)  # [N]
    if not finite.all():
        raise ValueError(f"conf_logits: expected finite logits, round {int(np.flatnonzero(~finite)[0])} holds NaN "
                         f"or inf")
    grid = np.asarray(grid, np.float64).ravel()
    if grid.size == 0 or not np.all(np.isfinite(grid) & (grid > 0)):
        raise ValueError(f"grid: expected positive finite temperatures, got {grid.tolist()}")
    # ties (equal ECE) go to the temperature nearest 1: the least change to the head's own confidences
    grid = np.asarray(sorted(grid, key=lambda t: (abs(np.log(t)), t)), np.float32)
    event, observed = events(accepted, verified, g)
    seen = np.asarray(jnp.any(observed, axis=0))
    if not seen.any():
        raise ValueError("fit_sts: no observed positions (every round verified 0 drafts)")
    temps, biases, _ = _fit(conf_logits, event, observed, jnp.asarray(grid), jnp.asarray(bias_grid, jnp.float32))
    # a position no round verified has no evidence: every candidate scores ECE 0 there, so keep it as the head
    # gave it (T = 1, offset 0) rather than the first candidate of the grid
    temps = np.where(seen, np.asarray(temps), np.float32(1.0)).astype(np.float32)
    biases = np.where(seen, np.asarray(biases), np.float32(0.0)).astype(np.float32)
    return temps, biases


def fit_sts(conf_logits, accepted, verified, grid=STS_GRID) -> np.ndarray:
    """Fit STS temperatures [G] on held-out rounds (Sequential Temperature Scaling, spec section 4).

    Position by position, the temperature of the grid whose calibrated survival has the least ECE against
    the observed survival, given the temperatures already chosen for the earlier positions.

    Args:
      conf_logits: float [N, G], the confidence head's raw logits of N drafted rounds.
      accepted: int [N], drafts accepted in each round.
      verified: int [N], drafts verified in each round (positions beyond it are unobserved).
      grid: candidate temperatures (positive); of equally good ones the nearest 1 is kept.
    Returns:
      float32 [G] temperatures (use with `apply_sts`); a position no round verified keeps T = 1.

    >>> logits = np.array([[4.0], [4.0], [4.0], [4.0]])  # overconfident: sigmoid(4) = 0.98, half survive
    >>> fit_sts(logits, accepted=[1, 0, 1, 0], verified=[1, 1, 1, 1]).tolist() > [1.0]
    True
    """
    return _fit_checked(conf_logits, accepted, verified, grid, (0.0,))[0]


def fit_sts_bias(conf_logits, accepted, verified, grid=STS_GRID, bias_grid=STS_BIAS_GRID
                 ) -> tuple[np.ndarray, np.ndarray]:
    """STS with a per-position logit offset (Platt scaling, fitted sequentially like `fit_sts`).

    Position by position, the (temperature, offset) pair of the grids' product whose calibrated survival
    ``prod_{i<=k} sigmoid(logit_i / T_i + b_i)`` has the least ECE, given the earlier positions' pairs; ties
    keep the offset listed first (`STS_BIAS_GRID` runs from 0 outwards), then the temperature nearest 1. A
    position no round verified keeps T = 1 and offset 0.

    Args:
      conf_logits: float [N, G]; accepted, verified: int [N] (as in `fit_sts`).
      grid: candidate temperatures; bias_grid: candidate offsets.
    Returns:
      (temperatures float32 [G], offsets float32 [G]), for `apply_sts`.

    >>> logits = np.array([[1.0], [2.0], [1.0], [2.0]])  # reads 0.73-0.88 where a quarter survive
    >>> temps, offsets = fit_sts_bias(logits, accepted=[1, 0, 0, 0], verified=[1, 1, 1, 1])
    >>> bool(offsets[0] < 0), float(fit_sts(logits, [1, 0, 0, 0], [1, 1, 1, 1])[0]) > 1
    (True, True)
    """
    return _fit_checked(conf_logits, accepted, verified, grid, bias_grid)


def calibration_report(conf_logits, accepted, verified, temperatures=None, biases=None) -> dict:
    """ECE (20 bins), AUROC and Brier per position and pooled, raw and after STS (with its offsets
    ``biases`` [G] when given), plus reliability bins."""
    conf_logits = jnp.asarray(conf_logits, jnp.float32)
    g = conf_logits.shape[1]
    event, observed = events(accepted, verified, g)
    raw = survival_from_logits(conf_logits, jnp.ones((g,)))
    sts = None if temperatures is None else survival_from_logits(
        conf_logits, jnp.asarray(temperatures), None if biases is None else jnp.asarray(biases, jnp.float32))
    out = {"per_position": [], "n_rounds": int(conf_logits.shape[0])}
    for k in range(g):
        w, e = observed[:, k], event[:, k]
        row = {"position": k + 1, "n": int(w.sum()), "survival_observed": float(jnp.sum(e * w) / jnp.maximum(w.sum(), 1)),
               "ece_raw": float(ece(raw[:, k], e, w)), "brier_raw": float(brier(raw[:, k], e, w)),
               "auroc_raw": auroc(raw[:, k], e, w)}
        if sts is not None:
            row.update(ece_sts=float(ece(sts[:, k], e, w)), brier_sts=float(brier(sts[:, k], e, w)),
                       auroc_sts=auroc(sts[:, k], e, w))
        out["per_position"].append(row)
    out["ece_raw"] = float(ece(raw, event, observed))
    out["brier_raw"] = float(brier(raw, event, observed))
    out["auroc_raw"] = auroc(raw, event, observed)
    out["reliability_raw"] = reliability_bins(raw, event, observed)
    if sts is not None:
        out["ece_sts"] = float(ece(sts, event, observed))
        out["brier_sts"] = float(brier(sts, event, observed))
        out["auroc_sts"] = auroc(sts, event, observed)
        out["reliability_sts"] = reliability_bins(sts, event, observed)
        out["temperatures"] = [float(t) for t in np.asarray(temperatures)]
        if biases is not None:
            out["biases"] = [float(b) for b in np.asarray(biases)]
    return out


@dataclasses.dataclass(frozen=True)
class STSSets:
    """STS temperatures fitted at one or more sampling temperatures.

    A draft survives by a different rule at each sampling temperature (the target's argmax at 0, rejection
    sampling against the target's distribution above), so the confidence head's logits map to survival
    differently: each request uses the set fitted at the sampling temperature nearest its own (`sts_for_rows`;
    at a tie the lower one).

    Fields: ``at`` float32 [K] sampling temperatures, ascending and distinct; ``temperatures`` float32 [K, G];
    ``biases`` float32 [K, G], the logit offsets of `fit_sts_bias` (zeros, plain STS, when not given).

    >>> sets = STSSets.of({1.0: [0.5, 0.5], 0.0: [1.0, 2.0]})
    >>> sets.at.tolist(), sets.for_temperature(0.0).tolist(), sets.for_temperature(0.8).tolist()
    ([0.0, 1.0], [1.0, 2.0], [0.5, 0.5])
    """

    at: np.ndarray
    temperatures: np.ndarray
    biases: np.ndarray | None = None

    def __post_init__(self):
        at = np.asarray(self.at, np.float32)
        temps = np.asarray(self.temperatures, np.float32)
        biases = np.zeros_like(temps) if self.biases is None else np.asarray(self.biases, np.float32)
        if at.ndim != 1 or temps.ndim != 2 or temps.shape[0] != at.shape[0] or at.shape[0] == 0 or temps.shape[1] == 0:
            raise ValueError(f"STS sets: expected at [K] and temperatures [K, G] with K, G >= 1, got shapes "
                             f"{at.shape} and {temps.shape}")
        if not np.all(np.isfinite(at)) or np.any(at < 0) or np.any(np.diff(at) <= 0):
            raise ValueError(f"STS sets: sampling temperatures must be finite, >= 0, ascending and distinct, got "
                             f"{at.tolist()}")
        if not np.all(np.isfinite(temps)) or np.any(temps <= 0):
            raise ValueError("STS sets: expected positive, finite STS temperatures")
        if biases.shape != temps.shape or not np.all(np.isfinite(biases)):
            raise ValueError(f"STS sets: expected finite offsets of the temperatures' shape {temps.shape}, got "
                             f"shape {biases.shape}")
        object.__setattr__(self, "at", at)
        object.__setattr__(self, "temperatures", temps)
        object.__setattr__(self, "biases", biases)

    @classmethod
    def of(cls, sets: "STSSets | Mapping[float, Sequence[float]] | Sequence[float] | np.ndarray",
           at: float = 1.0) -> "STSSets":
        """From ``{sampling temperature: [G]}``, or one set [G] (fitted at ``at``, used at every temperature)."""
        if isinstance(sets, STSSets):
            return sets
        if isinstance(sets, Mapping):
            items = sorted(((float(k), v) for k, v in sets.items()), key=lambda kv: kv[0])
            if not items or len({len(np.ravel(v)) for _, v in items}) != 1:
                raise ValueError("STS sets: expected {sampling temperature: [G]} with at least one set, all of "
                                 "the same length G")
            return cls(np.asarray([k for k, _ in items]), np.stack([np.asarray(v, np.float32) for _, v in items]))
        temps = np.asarray(sets, np.float32)
        if temps.ndim != 1:
            raise ValueError(f"STS temperatures: expected [G] (one per block position), got shape {temps.shape}")
        return cls(np.asarray([at]), temps[None])

    @property
    def block(self) -> int:
        return int(self.temperatures.shape[1])

    def for_temperature(self, temperature: float) -> np.ndarray:
        """The set [G] a request sampling at ``temperature`` uses."""
        return np.asarray(sts_for_rows(self.at, self.temperatures, jnp.asarray([temperature], jnp.float32))[0])

    def biases_for_temperature(self, temperature: float) -> np.ndarray:
        """The offsets [G] a request sampling at ``temperature`` uses (with `for_temperature`'s set)."""
        return np.asarray(sts_for_rows(self.at, self.biases, jnp.asarray([temperature], jnp.float32))[0])


@jax.jit
def sts_for_rows(at: jax.Array, temperatures: jax.Array, sampling_temperature: jax.Array) -> jax.Array:
    """Each row's STS set: the one fitted at the sampling temperature nearest the row's (ties: the lower).

    Args:
      at: float [K] ascending sampling temperatures of the sets; temperatures: float [K, G] (or any table
        of one row per set, such as `STSSets.biases`); sampling_temperature: float [R] (0 for greedy rows).
    Returns:
      float32 [R, G], for `apply_sts`.

    >>> sts_for_rows(jnp.array([0.0, 1.0]), jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([0.0, 0.7])).tolist()
    [[1.0, 2.0], [3.0, 4.0]]
    """
    if jnp.ndim(at) != 1 or jnp.ndim(temperatures) != 2 or jnp.shape(temperatures)[0] != jnp.shape(at)[0]:
        raise ValueError(f"sts_for_rows: expected at [K] and temperatures [K, G] (one row per set), got shapes "
                         f"{jnp.shape(at)} and {jnp.shape(temperatures)}")
    if jnp.ndim(sampling_temperature) != 1:
        raise ValueError(f"sampling_temperature: expected [R] (one per row), got shape "
                         f"{jnp.shape(sampling_temperature)}")
    gap = jnp.abs(sampling_temperature.astype(jnp.float32)[:, None] - at.astype(jnp.float32)[None, :])
    return temperatures.astype(jnp.float32)[jnp.argmin(gap, axis=-1)]


def save_temperatures(path: str | os.PathLike, temperatures, info: dict | None = None) -> None:
    """Write ``{"temperatures": [...], ...}`` as JSON, atomically (beside the drafter checkpoint)."""
    atomic_write_text(path, json.dumps({"temperatures": [float(t) for t in temperatures], **(info or {})},
                                       indent=1) + "\n")


def save_sts(path: str | os.PathLike, sets: STSSets, info: Sequence[dict] | None = None) -> None:
    """Write STS sets as JSON, atomically: ``sets`` lists ``{"temperature": t, "temperatures": [G], "biases":
    [G], ...}`` (offsets written only where a set has any; with the matching ``info`` entry merged in); the
    top-level ``temperatures`` and ``temperature`` repeat the set fitted at the highest sampling temperature,
    for readers of a single set (`load_temperatures`)."""
    info = list(info or [{} for _ in sets.at])
    if len(info) != len(sets.at):
        raise ValueError(f"save_sts: {len(info)} info entries for {len(sets.at)} sets")
    entries = [{"temperature": float(t), "temperatures": [float(x) for x in temps],
                **({"biases": [float(x) for x in b]} if np.any(b != 0) else {}), **extra}
               for t, temps, b, extra in zip(sets.at, sets.temperatures, sets.biases, info)]
    obj = {"temperatures": entries[-1]["temperatures"], "temperature": entries[-1]["temperature"], "sets": entries}
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def _read_sts_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"STS temperatures {path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"STS temperatures {path}: not valid JSON ({err})") from err


def _positive_list(values, where: str) -> np.ndarray:
    try:
        temps = np.asarray(values, np.float32)
    except (TypeError, ValueError):
        temps = np.zeros((0,), np.float32)
    if temps.ndim != 1 or len(temps) == 0 or not np.all(np.isfinite(temps)) or np.any(temps <= 0):
        raise ValueError(f"{where}: expected a non-empty list of positive numbers")
    return temps


def _finite_list(values, length: int, where: str) -> np.ndarray:
    """Offsets: ``length`` finite numbers, zeros when absent (``None``)."""
    if values is None:
        return np.zeros((length,), np.float32)
    try:
        out = np.asarray(values, np.float32)
    except (TypeError, ValueError):
        out = np.zeros((0,), np.float32)
    if out.shape != (length,) or not np.all(np.isfinite(out)):
        raise ValueError(f"{where}: expected {length} finite numbers (one per block position)")
    return out


def load_temperatures(path: str | os.PathLike) -> np.ndarray:
    """One STS set [G]: the file's top-level ``temperatures`` (with several sets, the one fitted at the highest
    sampling temperature; `load_sts` reads them all)."""
    return _positive_list(_read_sts_json(path).get("temperatures", []), f"STS temperatures {path}")


def load_sts(path: str | os.PathLike) -> STSSets:
    """Every STS set of an ``sts.json`` (`save_sts`); a file of one set (``temperatures``, fitted at its
    ``temperature``, 1 when absent) gives one set, used at every sampling temperature."""
    obj = _read_sts_json(path)
    if "sets" not in obj:
        t = obj.get("temperature", 1.0)
        temps = _positive_list(obj.get("temperatures", []), f"STS temperatures {path}")
        return STSSets.of(temps, at=1.0 if t is None else float(t))
    sets = obj["sets"]
    if not isinstance(sets, list) or not sets or not all(isinstance(e, dict) for e in sets):
        raise ValueError(f"STS temperatures {path}: 'sets' must be a non-empty list of "
                         f"{{\"temperature\": t, \"temperatures\": [...]}}")
    rows = [_positive_list(e.get("temperatures", []), f"STS temperatures {path}: sets[{i}].temperatures")
            for i, e in enumerate(sets)]
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"STS temperatures {path}: the sets have different lengths {[len(r) for r in rows]}")
    biases = [_finite_list(e.get("biases"), len(r), f"STS temperatures {path}: sets[{i}].biases")
              for i, (e, r) in enumerate(zip(sets, rows))]
    try:
        at = [float(e["temperature"]) for e in sets]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"STS temperatures {path}: every set needs a numeric 'temperature'") from err
    order = np.argsort(at, kind="stable")
    try:
        return STSSets(np.asarray(at)[order], np.stack(rows)[order], np.stack(biases)[order])
    except ValueError as err:
        raise ValueError(f"STS temperatures {path}: {err}") from err
