"""Closed-loop serving measurements over the engine (the serving benchmark and the demo use this).

N users each send their next prompt as soon as their previous answer finishes, so the engine holds N
requests at all times. Throughput is measured over rounds that compiled nothing (steady state), in windows
of rounds repeated to give a spread.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import itertools
from pathlib import Path
from typing import Sequence

import numpy as np

from dspark_jax import scheduler
from dspark_jax.data import load_prompts
from dspark_jax.engine import Engine, RoundStats

DOMAINS = {"gsm8k": "math", "mbpp": "code", "livecodebench": "code", "arena-hard": "chat", "mt-bench": "chat"}


def shipped_prompts_dir() -> Path:
    return Path(str(importlib.resources.files("dspark_jax"))) / "assets" / "prompts"


def mixed_prompts(tokenizer, source: str | Path | None = None, *, per_file: int | None = None,
                  max_prompt_tokens: int = 384, seed: int = 0) -> list[tuple[str, list[int]]]:
    """(domain, token ids) of prompts mixing math, code and chat, interleaved by domain.

    ``source``: a folder of JSONL prompt files (default: ``../shared/data/prompts/dev`` when present,
    else the few prompts shipped with the package). Prompts longer than ``max_prompt_tokens`` are skipped.
    """
    if source is None:
        dev = Path("../shared/data/prompts/dev")
        source = dev if dev.is_dir() else shipped_prompts_dir()
    prompts = load_prompts([source], limit=per_file)
    by_domain: dict[str, list[list[int]]] = {}
    for p in prompts:
        ids = tokenizer.encode_chat([p.turns[0]])
        if len(ids) <= max_prompt_tokens:
            by_domain.setdefault(DOMAINS.get(p.domain, p.domain), []).append(ids)
    rng = np.random.default_rng(seed)
    for v in by_domain.values():
        rng.shuffle(v)
    out = []
    for group in itertools.zip_longest(*by_domain.values()):
        for domain, ids in zip(by_domain, group):
            if ids is not None:
                out.append((domain, ids))
    if not out:
        raise ValueError(f"no prompts of at most {max_prompt_tokens} tokens in {source}")
    return out


@dataclasses.dataclass
class LoadResult:
    """One (policy, concurrency, temperature) measurement."""

    tokens_per_s: float  # median over the repeats
    tokens_per_s_spread: float  # half the range of the repeats
    repeats: list[float]
    accept_len: float  # mean (accepted drafts + 1) per request-round
    drafts_per_request: float  # mean scheduled drafts per request per round
    rejected_share: float  # share of verified drafts that were rejected
    mean_batch_tokens: float
    steady_rounds: int
    compiled_rounds: int
    completed_requests: int
    rounds: list[RoundStats]


class ClosedLoop:
    """``concurrency`` users against ``engine``, each sending its next prompt (in order, cycling) as soon as
    its previous answer finished; :meth:`window` runs rounds and returns their stats.
    Several loops can take turns (the interleaved serving benchmark): each keeps its engine's state."""

    def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int):
        if concurrency > engine.cfg.num_slots:
            raise ValueError(f"concurrency {concurrency} exceeds the engine's {engine.cfg.num_slots} slots")
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        self.engine, self.prompts, self.concurrency, self.max_new_tokens = engine, prompts, concurrency, max_new_tokens
        self._next = 0
        self.submitted = 0

    def _top_up(self) -> None:
        while self.submitted - len(self.engine.finished_ids) < self.concurrency:
            self.engine.submit(self.prompts[self._next], self.max_new_tokens)
            self._next = (self._next + 1) % len(self.prompts)
            self.submitted += 1

    def window(self, rounds: int, min_tokens: int = 0) -> list[RoundStats]:
        """Run at least ``rounds`` rounds and until at least ``min_tokens`` tokens were emitted."""
        out, tokens = [], 0
        while len(out) < rounds or tokens < min_tokens:
            self._top_up()
            stats = self.engine.step()
            if stats is not None:
                out.append(stats)
                tokens += stats.emitted
        return out


def closed_loop(engine: Engine, prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int, *,
                warmup_rounds: int, measure_rounds: int, repeats: int = 1, min_window_tokens: int = 0) -> LoadResult:
    """Run ``concurrency`` users against ``engine`` (:class:`ClosedLoop`); measure ``repeats`` windows of at
    least ``measure_rounds`` rounds and at least ``min_window_tokens`` emitted tokens each.

    The token floor keeps low-concurrency windows from timing a few dozen tokens of one answer: at one user a
    window of 12 rounds would be 12 to 20 tokens. Rounds in which something compiled are excluded from the
    throughput (their time is compile time).
    """
    loop = ClosedLoop(engine, prompts, concurrency, max_new_tokens)
    loop.window(warmup_rounds)
    windows = [loop.window(measure_rounds, min_window_tokens) for _ in range(repeats)]
    return summarize_windows(windows, completed_requests=len(engine.finished_ids))


def summarize_windows(windows: Sequence[Sequence[RoundStats]], *, completed_requests: int = 0) -> LoadResult:
    """A :class:`LoadResult` from measurement windows (lists of rounds): tokens/s per window over its rounds
    that compiled nothing, their median and half their range, and the counters over all steady rounds."""
    rates = []
    for w in windows:
        steady = [r for r in w if not r.compiled]
        secs = sum(r.seconds for r in steady)
        rates.append(sum(r.emitted for r in steady) / secs if secs > 0 else float("nan"))
    rounds = [r for w in windows for r in w]
    steady = [r for r in rounds if not r.compiled]
    sched = np.concatenate([r.scheduled for r in steady]) if steady else np.zeros(0)
    acc = np.concatenate([r.accepted for r in steady]) if steady else np.zeros(0)
    rates_arr = np.asarray(rates)
    return LoadResult(
        tokens_per_s=float(np.nanmedian(rates_arr)),
        tokens_per_s_spread=float((np.nanmax(rates_arr) - np.nanmin(rates_arr)) / 2) if len(rates) > 1 else 0.0,
        repeats=[float(x) for x in rates],
        accept_len=float(np.mean(acc + 1)) if acc.size else float("nan"),
        drafts_per_request=float(sched.mean()) if sched.size else 0.0,
        rejected_share=float(1 - acc.sum() / sched.sum()) if sched.sum() > 0 else 0.0,
        mean_batch_tokens=float(np.mean([r.batch_tokens for r in steady])) if steady else float("nan"),
        steady_rounds=len(steady),
        compiled_rounds=len(rounds) - len(steady),
        completed_requests=completed_requests,
        rounds=rounds,
    )


def scheduling_quality(rounds: Sequence[RoundStats], table) -> dict[str, float]:
    """Expected throughput of Algorithm 1 (first drop) against the best point of the greedy path, on the
    recorded confidences of real rounds, each with the steps/s curve the engine used for it (the table's
    cost model at the round's requests and context, or its simple curve)."""
    ratios = []
    for r in rounds:
        if r.confidences is None or len(r.confidences) == 0 or not r.drafted:
            continue
        sps = table.sps_for(r.active, r.context) if table.cost_model is not None else table.to_dense()
        conf = np.asarray(r.confidences, np.float32)
        first = float(scheduler.schedule(conf, sps).throughput)
        best = float(scheduler.schedule(conf, sps, stop="argmax").throughput)
        if best > 0:
            ratios.append(first / best)
    if not ratios:
        return {"rounds": 0}
    ratios = np.asarray(ratios)
    return {"rounds": int(len(ratios)), "mean_ratio": float(ratios.mean()), "min_ratio": float(ratios.min()),
            "share_equal": float(np.mean(ratios > 1 - 1e-6)), "share_within_2pct": float(np.mean(ratios >= 0.98))}
