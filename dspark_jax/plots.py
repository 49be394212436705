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


def _log2_ticks(ax, values) -> None:
    """A log2 x axis labelled with the values themselves."""
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(v) for v in values], [str(int(v)) for v in values])
    ax.minorticks_off()


def plot_sps(table, out_png: str | os.PathLike, title: str = "") -> Path:
    """An SPS table (``dspark_jax.sps.SPSTable``): rounds/s and verified tokens/s against the batch B, one
    line per context length (with ``realistic_rows(B)`` requests, the draft cost included); the draft cost
    against the number of requests R; and the verification time against B for each row count at the
    reference context (how many requests change the cost at the same B). A table without a cost model
    gets the first panels from its points only."""
    plt = _plt()
    cm = table.cost_model
    meta = table.metadata
    panels = 2 if cm is None else 4
    fig, ax = plt.subplots(1, panels, figsize=(4.5 * panels, 4))
    if cm is None:
        curves = {meta.context_length: (table.batch_tokens, table.steps_per_s)}
    else:
        curves = {}
        for L in cm.context_lengths:
            c = cm.curve(L)
            curves[L] = (c["batch_tokens"], 1.0 / c["step_s"])
    for L, (b, sps) in curves.items():
        ax[0].plot(b, sps, "o-", label=f"L = {L}")
        ax[1].plot(b, b * sps, "o-", label=f"L = {L}")
    for a, name in ((ax[0], "rounds/s (draft + verify)"), (ax[1], "verified tokens/s (B x rounds/s)")):
        _log2_ticks(a, next(iter(curves.values()))[0])
        a.set_xlabel("verification tokens B")
        a.set_title(name)
        a.legend(title="context per request", fontsize=8)
    if cm is not None:
        rows = np.asarray(cm.rows)
        for c, L in enumerate(cm.context_lengths):
            ax[2].plot(rows, 1e3 * np.asarray(cm.draft_s[c]), "o-", label=f"L = {L}")
        _log2_ticks(ax[2], rows)
        ax[2].set_xlabel("requests R (row bucket)")
        ax[2].set_ylabel("ms")
        ax[2].set_title("draft cost per round")
        ax[2].legend(fontsize=8)
        verify, _ = cm.filled_verify()
        measured = cm.measured
        c = cm.context_lengths.index(meta.context_length) if meta.context_length in cm.context_lengths else 0
        b = np.asarray(cm.batch_tokens)
        for r, R in enumerate(cm.rows):
            keep = measured[c, r]
            if keep.any():
                ax[3].plot(b[keep], 1e3 * verify[c, r][keep], "o-", label=f"R = {R}")
        _log2_ticks(ax[3], b)
        ax[3].set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter

        ax[3].yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax[3].yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax[3].set_xlabel("verification tokens B (bucket)")
        ax[3].set_ylabel("ms")
        ax[3].set_title(f"verification, measured cells, L = {cm.context_lengths[c]}")
        ax[3].legend(fontsize=7, ncol=2)
    sub = f"{meta.model}, {meta.dtype}, {meta.backend} ({meta.device_kind}), {meta.date}"
    fig.suptitle(f"{title}\n{sub}" if title else sub)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def _throughput(row: dict) -> float:
    """A serving row's throughput: over all its windows where recorded (interleaved runs), else the median."""
    return row.get("tokens_per_s_pooled", row["tokens_per_s"])


def plot_serving(rows: Sequence[dict], out_dir: str | os.PathLike) -> list[Path]:
    """Throughput and scheduled drafts against concurrency (paper fig. 8), throughput against per-user
    speed (fig. 7); one figure per temperature. Rows with pooled ratios (interleaved runs) plot throughput
    over all windows and add a panel of each policy's ratio to `none` with its paired 95% interval; rows
    without plot the median window and half the range of the windows."""
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for temp in sorted({r["temperature"] for r in rows}):
        rs = [r for r in rows if r["temperature"] == temp]
        policies = list(dict.fromkeys(r["policy"] for r in rs))
        pooled = all(r.get("ratio_vs_none_ci") for r in rs)
        fig, ax = plt.subplots(3 if pooled else 2, 1, figsize=(7, 11 if pooled else 8), sharex=True)
        for pol in policies:
            pts = sorted((r["concurrency"], r) for r in rs if r["policy"] == pol)
            xs = [c for c, _ in pts]
            if pooled:
                ax[0].plot(xs, [_throughput(r) for _, r in pts], marker="o", label=pol)
                ratio = np.array([r["ratio_vs_none_pooled"] for _, r in pts])
                ci = np.array([r["ratio_vs_none_ci"] for _, r in pts])
                ax[1].errorbar(xs, ratio, yerr=[ratio - ci[:, 0], ci[:, 1] - ratio], marker="o", capsize=3, label=pol)
            else:
                ax[0].errorbar(xs, [r["tokens_per_s"] for _, r in pts],
                               yerr=[r["tokens_per_s_spread"] for _, r in pts], marker="o", capsize=3, label=pol)
            ax[-1].plot(xs, [r["drafts_per_request"] for _, r in pts], marker="o", label=pol)
        ax[0].set_ylabel("total output tokens/s" + (" (all windows)" if pooled else ""))
        ax[0].set_xscale("log", base=2)
        ax[0].legend(fontsize=8)
        if pooled:
            ax[1].axhline(1.0, color="0.5", lw=0.8)
            ax[1].set_ylabel("throughput / none (paired 95% interval)")
        ax[-1].set_ylabel("scheduled drafts per request per round")
        ax[-1].set_xlabel("concurrent users")
        fig.suptitle(f"throughput and verified length vs load (temperature {temp:g})")
        fig.tight_layout()
        path = out_dir / f"serving_load_t{temp:g}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
        fig, ax = plt.subplots(figsize=(7, 5))
        for pol in policies:
            pts = sorted((r["concurrency"], r) for r in rs if r["policy"] == pol)
            ax.plot([_throughput(r) / r["concurrency"] for _, r in pts], [_throughput(r) for _, r in pts],
                    marker="o", label=pol)
        ax.set_xlabel("tokens/s per user")
        ax.set_ylabel("total output tokens/s")
        ax.set_title(f"throughput against per-user speed (temperature {temp:g})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"serving_tradeoff_t{temp:g}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
