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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.io import atomic_write_text

__all__ = ["STS_GRID", "ece", "brier", "auroc", "reliability_bins", "apply_sts", "survival_from_logits",
           "fit_sts", "events", "calibration_report", "save_temperatures", "load_temperatures"]

STS_GRID = tuple(float(2.0 ** (i / 10)) for i in range(-30, 31))
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
def apply_sts(conf_logits: jax.Array, temperatures: jax.Array) -> jax.Array:
    """Calibrated per-position confidences ``sigmoid(logit_k / T_k)``: [..., G], [G] -> [..., G].

    >>> [round(float(c), 3) for c in apply_sts(jnp.array([[0.0, 2.0]]), jnp.array([1.0, 2.0]))[0]]
    [0.5, 0.731]
    """
    return jax.nn.sigmoid(conf_logits.astype(jnp.float32) / temperatures.astype(jnp.float32))


@jax.jit
def survival_from_logits(conf_logits: jax.Array, temperatures: jax.Array) -> jax.Array:
    """Predicted survival ``prod_{i<=k} sigmoid(logit_i / T_i)``: [N, G] -> [N, G]."""
    return jnp.cumprod(apply_sts(conf_logits, temperatures), axis=-1)


@jax.jit
def _fit(conf_logits, event, observed, grid):
    """STS core: a lax.scan over positions, each choosing the grid temperature of least ECE."""
    n, g = conf_logits.shape

    def step(prefix, k):
        logit_k = conf_logits[:, k]
        w = observed[:, k].astype(jnp.float32)
        e = event[:, k]
        # [P, N] survival at position k for every candidate temperature
        cand = prefix[None, :] * jax.nn.sigmoid(logit_k[None, :] / grid[:, None])
        errs = jax.vmap(lambda p: ece(p, e, w))(cand)
        best = jnp.argmin(errs)  # first minimum: ties keep the smaller temperature
        return cand[best], (grid[best], errs[best])

    _, (temps, errs) = jax.lax.scan(step, jnp.ones((n,), jnp.float32), jnp.arange(g))
    return temps, errs


def fit_sts(conf_logits, accepted, verified, grid=STS_GRID) -> np.ndarray:
    """Fit STS temperatures [G] on held-out rounds (Sequential Temperature Scaling, spec section 2.3).

    Position by position, the temperature of the grid whose calibrated survival has the least ECE against
    the observed survival, given the temperatures already chosen for the earlier positions.

    Args:
      conf_logits: float [N, G], the confidence head's raw logits of N drafted rounds.
      accepted: int [N], drafts accepted in each round.
      verified: int [N], drafts verified in each round (positions beyond it are unobserved).
      grid: candidate temperatures.
    Returns:
      float32 [G] temperatures (use with `apply_sts`).

    >>> logits = np.array([[4.0], [4.0], [4.0], [4.0]])  # overconfident: sigmoid(4) = 0.98, half survive
    >>> fit_sts(logits, accepted=[1, 0, 1, 0], verified=[1, 1, 1, 1]).tolist() > [1.0]
    True
    """
    conf_logits = jnp.asarray(conf_logits, jnp.float32)
    if conf_logits.ndim != 2:
        raise ValueError(f"conf_logits: expected [N, G], got shape {conf_logits.shape}")
    event, observed = events(accepted, verified, conf_logits.shape[1])
    if not bool(jnp.any(observed)):
        raise ValueError("fit_sts: no observed positions (every round verified 0 drafts)")
    temps, _ = _fit(conf_logits, event, observed, jnp.asarray(grid, jnp.float32))
    return np.asarray(temps)


def calibration_report(conf_logits, accepted, verified, temperatures=None) -> dict:
    """ECE (20 bins), AUROC and Brier per position and pooled, raw and after STS, plus reliability bins."""
    conf_logits = jnp.asarray(conf_logits, jnp.float32)
    g = conf_logits.shape[1]
    event, observed = events(accepted, verified, g)
    raw = survival_from_logits(conf_logits, jnp.ones((g,)))
    sts = None if temperatures is None else survival_from_logits(conf_logits, jnp.asarray(temperatures))
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
    return out


def save_temperatures(path: str | os.PathLike, temperatures, info: dict | None = None) -> None:
    """Write ``{"temperatures": [...], ...}`` as JSON, atomically (beside the drafter checkpoint)."""
    atomic_write_text(path, json.dumps({"temperatures": [float(t) for t in temperatures], **(info or {})},
                                       indent=1) + "\n")


def load_temperatures(path: str | os.PathLike) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"STS temperatures {path}: file not found")
    obj = json.loads(path.read_text())
    temps = np.asarray(obj.get("temperatures", []), np.float32)
    if temps.ndim != 1 or len(temps) == 0 or not np.all(np.isfinite(temps)) or np.any(temps <= 0):
        raise ValueError(f"STS temperatures {path}: expected a non-empty list of positive numbers")
    return temps
