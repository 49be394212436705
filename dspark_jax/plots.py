"""Plots (PNG, matplotlib with the Agg backend): training curves, reliability diagrams, SPS curves, serving."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, title: str = "") -> Path:
    """Loss terms, probabilistic tau and per-slot acceptance c* against the step."""
    plt = _plt()
    rows = [json.loads(l) for l in Path(metrics_jsonl).read_text().splitlines() if l.strip()]
    if not rows:
        raise ValueError(f"{metrics_jsonl}: no metrics logged yet")
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for key in ("loss", "ce", "l1", "conf"):
        ax[0].plot(steps, [r[key] for r in rows], label=key)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].legend()
    ax[0].set_title("loss terms")
    ax[1].plot(steps, [r["tau_prob"] for r in rows])
    ax[1].set_xlabel("step")
    ax[1].set_title("probabilistic tau (1 + sum prod c*)")
    c = np.array([r["c_star"] for r in rows])
    for k in range(c.shape[1]):
        ax[2].plot(steps, c[:, k], label=f"slot {k}")
    ax[2].set_xlabel("step")
    ax[2].set_title("c* per slot (acceptance given prefix)")
    ax[2].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def plot_reliability(bins: Sequence[dict], out_png: str | os.PathLike, title: str = "") -> Path:
    """Reliability diagrams: each entry of ``bins`` is {"label", "pred" [20], "obs" [20], "count" [20]}."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(bins), figsize=(4 * len(bins), 4), squeeze=False)
    for ax, b in zip(axes[0], bins):
        pred, obs, cnt = (np.asarray(b[k], float) for k in ("pred", "obs", "count"))
        keep = cnt > 0
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.scatter(pred[keep], obs[keep], s=10 + 90 * cnt[keep] / cnt.max())
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted survival")
        ax.set_ylabel("observed survival")
        ax.set_title(b["label"])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
