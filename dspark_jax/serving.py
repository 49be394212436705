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
    repeats: list[float]  # tokens/s of each window
    window_emitted: list[int]  # tokens each window emitted in its rounds that compiled nothing
    window_seconds: list[float]  # and their seconds
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
    its previous answer finished; :meth:`run_until` runs rounds and returns their stats.
    Several loops can take turns (the interleaved serving benchmark): each keeps its engine's state."""

    def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int):
        if concurrency > engine.cfg.num_slots:
            raise ValueError(f"concurrency {concurrency} exceeds the engine's {engine.cfg.num_slots} slots")
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        self.engine, self.prompts, self.concurrency, self.max_new_tokens = engine, prompts, concurrency, max_new_tokens
        self._next = 0
        self.submitted = 0
        self._finished_before = len(engine.finished_ids)  # requests the engine finished before this loop
        self.emitted = 0  # tokens emitted since the loop started

    def _top_up(self) -> None:
        while self.submitted - (len(self.engine.finished_ids) - self._finished_before) < self.concurrency:
            self.engine.submit(self.prompts[self._next], self.max_new_tokens)
            self._next = (self._next + 1) % len(self.prompts)
            self.submitted += 1

    def run_until(self, total_tokens: int) -> list[RoundStats]:
        """Run rounds until the loop has emitted ``total_tokens`` tokens since it started (at least one round).

        Windows that end at the same emitted-token count pair up across loops: every loop sends the same
        prompts in the same order, so (exactly so at temperature 0, decoding being lossless) window k of each
        loop serves the same answers up to the tokens of one round, whatever the policy. Windows of a fixed
        number of rounds would not: a policy that emits more tokens per round reaches later, longer-context
        parts of the answers and more prompt prefills in its window, which moves its throughput by more
        than the policies differ at high load."""
        out = []
        while not out or self.emitted < total_tokens:
            stats = self.step()
            if stats is not None:
                out.append(stats)
        return out

    def step(self) -> RoundStats | None:
        """One engine step, the users' next prompts sent first: its round's stats (None: no request decoded)."""
        self._top_up()
        stats = self.engine.step().stats
        if stats is not None:
            self.emitted += stats.emitted
        return stats


def window_tokens(concurrency: int, rounds: int, min_tokens: int = 0) -> int:
    """Tokens per measurement window: what ``rounds`` rounds of plain decoding emit at ``concurrency``
    users, and at least ``min_tokens`` (a window at one user would otherwise time a few dozen tokens)."""
    if concurrency < 1 or rounds < 1:
        raise ValueError(f"window_tokens: expected concurrency >= 1 and rounds >= 1, got {concurrency}, {rounds}")
    return max(concurrency * rounds, min_tokens)


def closed_loop(engine: Engine, prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int, *,
                warmup_tokens: int, window_tokens: int, repeats: int = 1) -> LoadResult:
    """Run ``concurrency`` users against ``engine`` (:class:`ClosedLoop`): warm up until ``warmup_tokens``
    tokens came out, then measure ``repeats`` windows of ``window_tokens`` tokens each (window k ends at
    ``warmup_tokens + (k + 1) * window_tokens`` emitted tokens). Rounds in which something compiled are
    excluded from the throughput (their time is compile time)."""
    return interleaved({"": engine}, prompts, concurrency, max_new_tokens, warmup_tokens=warmup_tokens,
                       window_tokens=window_tokens, repeats=repeats)[""]


def interleaved(engines: dict[str, Engine], prompts: Sequence[Sequence[int]], concurrency: int,
                max_new_tokens: int, *, warmup_tokens: int, window_tokens: int,
                repeats: int = 1, turns: str = "round") -> dict[str, LoadResult]:
    """Closed loops over several engines (one per policy, say) taking turns, so that a drift of the machine's
    speed lands on all of them alike; windows end at the same emitted-token counts (:meth:`ClosedLoop.run_until`),
    so window k of every engine serves the same prompts. ``turns="round"`` (the default): within each window the
    engines step one round each in turn (an engine that has reached the window's end waits for the others), so
    a host whose speed moves within seconds, as a shared VM's does, slows every engine's rounds alike;
    the order of the turns is drawn afresh every cycle (a fixed seed), since a round right after a heavy round of
    another engine runs slower on a CPU; ``"window"``: each engine runs its whole window in turn, in an order
    rotated every repeat. Returns each engine's :class:`LoadResult`, whose ``repeats`` pair up across engines."""
    if window_tokens < 1 or repeats < 1 or warmup_tokens < 0:
        raise ValueError(f"expected window_tokens >= 1, repeats >= 1 and warmup_tokens >= 0, got "
                         f"{window_tokens}, {repeats}, {warmup_tokens}")
    if turns not in ("round", "window"):
        raise ValueError(f"turns: expected 'round' or 'window', got {turns!r}")
    names = list(engines)
    loops = {k: ClosedLoop(e, prompts, concurrency, max_new_tokens) for k, e in engines.items()}
    for loop in loops.values():
        loop.run_until(warmup_tokens)
    windows: dict[str, list[list[RoundStats]]] = {k: [] for k in names}
    rng = np.random.default_rng(0)
    for i in range(repeats):
        end = warmup_tokens + (i + 1) * window_tokens
        if turns == "window":
            shift = i % len(names)
            for k in names[shift:] + names[:shift]:
                windows[k].append(loops[k].run_until(end))
            continue
        current: dict[str, list[RoundStats]] = {k: [] for k in names}
        running = list(names)
        while running:  # as run_until: at least one round, then until the window's end
            # a new order every cycle: a round runs slower right after a heavy one (on XLA:CPU ~7% after a
            # fixed:7 round at 16 users), so a fixed cyclic order would charge that to one engine
            for k in [running[j] for j in rng.permutation(len(running))]:
                stats = loops[k].step()
                if stats is not None:
                    current[k].append(stats)
                if current[k] and loops[k].emitted >= end:
                    running.remove(k)
        for k in names:
            windows[k].append(current[k])
    return {k: summarize_windows(windows[k], completed_requests=len(loops[k].engine.finished_ids)) for k in names}


def summarize_windows(windows: Sequence[Sequence[RoundStats]], *, completed_requests: int = 0) -> LoadResult:
    """A :class:`LoadResult` from measurement windows (lists of rounds): tokens/s per window over its rounds
    that compiled nothing, their median and half their range, and the counters over all steady rounds."""
    emitted = [sum(r.emitted for r in w if not r.compiled) for w in windows]
    seconds = [float(sum(r.seconds for r in w if not r.compiled)) for w in windows]
    rates = [e / t if t > 0 else float("nan") for e, t in zip(emitted, seconds)]
    rounds = [r for w in windows for r in w]
    steady = [r for r in rounds if not r.compiled]
    sched = np.concatenate([r.scheduled for r in steady]) if steady else np.zeros(0)
    acc = np.concatenate([r.accepted for r in steady]) if steady else np.zeros(0)
    rates_arr = np.asarray(rates)
    return LoadResult(
        tokens_per_s=float(np.nanmedian(rates_arr)),
        tokens_per_s_spread=float((np.nanmax(rates_arr) - np.nanmin(rates_arr)) / 2) if len(rates) > 1 else 0.0,
        repeats=[float(x) for x in rates],
        window_emitted=[int(e) for e in emitted],
        window_seconds=seconds,
        accept_len=float(np.mean(acc + 1)) if acc.size else float("nan"),
        drafts_per_request=float(sched.mean()) if sched.size else 0.0,
        rejected_share=float(1 - acc.sum() / sched.sum()) if sched.sum() > 0 else 0.0,
        mean_batch_tokens=float(np.mean([r.batch_tokens for r in steady])) if steady else float("nan"),
        steady_rounds=len(steady),
        compiled_rounds=len(rounds) - len(steady),
        completed_requests=completed_requests,
        rounds=rounds,
    )


def pooled_ratio(emitted_a: Sequence[float], seconds_a: Sequence[float], emitted_b: Sequence[float],
                 seconds_b: Sequence[float], *, level: float = 0.95, resamples: int = 4000,
                 seed: int = 0) -> tuple[float, float, float]:
    """Throughput of A over B on paired windows: (sum of A's tokens / sum of A's seconds) over the same for B,
    with a paired bootstrap interval (windows resampled with replacement, each keeping its A and B, the
    ``level`` percentile range of ``resamples`` ratios; a fixed ``seed``). Window k of every engine serves the
    same answers, so the pooled ratio is the ratio of throughputs on one workload, and resampling pairs keeps
    what the content of a window does to both. Returns ``(ratio, low, high)``."""
    a_e, a_s, b_e, b_s = (np.asarray(x, np.float64) for x in (emitted_a, seconds_a, emitted_b, seconds_b))
    n = len(a_e)
    if not n or any(len(x) != n for x in (a_s, b_e, b_s)):
        raise ValueError(f"pooled_ratio: expected four sequences of one length >= 1, got "
                         f"{[len(x) for x in (a_e, a_s, b_e, b_s)]}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"pooled_ratio: level must lie in (0, 1), got {level}")
    if np.any(a_s <= 0) or np.any(b_s <= 0):
        raise ValueError("pooled_ratio: every window needs seconds > 0")
    ratio = (a_e.sum() / a_s.sum()) / (b_e.sum() / b_s.sum())
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    boot = (a_e[idx].sum(1) / a_s[idx].sum(1)) / (b_e[idx].sum(1) / b_s[idx].sum(1))
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(ratio), float(lo), float(hi)


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
