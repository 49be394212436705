"""Serving benchmark: DSpark scheduling against plain decoding and fixed-length speculation across load.

    python -m profiling.bench_serving --quick --json runs/serving_quick.json
    python -m profiling.bench_serving --json runs/serving.json --plots runs/serving

Closed loop: N users each send their next prompt (math, code and chat mixed) when their previous answer
finishes. For every concurrency, temperature and policy: total output tokens/s (median over repeated
measurement windows, spread = half their range), tokens/s per user, accepted length, mean scheduled drafts per
request per round and the share of verified drafts rejected; ratios against `none` and the best fixed K of
the same run. Each point runs once untimed first and is timed on fresh engines (`--prerun`, below); rounds
that still compiled are excluded from the timing. A window is a number of emitted tokens, the same for every
policy (`--rounds` x N, at least `--min-window-tokens`), so that window k of every policy serves the same
prompts (exactly the same answers at temperature 0, decoding being lossless).

Interleaved by default: at each (concurrency, temperature) every policy gets its own engine and closed loop
(warmed up first, the same prompt stream for each), and inside each measurement window the policies step one
round each in turn (`serving.interleaved`). A host whose speed drifts, even within seconds as a shared VM's
does, then slows every policy's rounds alike, and the per-window ratios (`ratio_vs_none_repeats`,
`ratio_vs_best_fixed_repeats`) show the spread of the ratios themselves; their medians (`ratio_vs_none_paired`,
`ratio_vs_best_fixed_paired`) are the paired estimates, which a drift between windows does not move. The
windows also differ in what they serve (a window of math answers accepts more drafts than one of chat), so the
per-window ratios spread by content as well as by noise; `ratio_vs_none_pooled` and `ratio_vs_best_fixed_pooled`
are the throughput over all windows against the reference's over the same windows, and `ratio_vs_none_ci`,
`ratio_vs_best_fixed_ci` their paired bootstrap 95% intervals (windows resampled with replacement, each keeping
both policies' times).
`--sequential` measures each policy's windows back to back on one engine instead.

`--json` is written after every point (`"complete": false` until the end), and `--resume` goes on from such
a file with the same settings, measuring only the points it lacks (the scheduling quality then covers the
new points' rounds only). Each point's compiled programs are dropped after it (`jax.clear_caches`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from dspark_jax.cli import nonnegative_int, parse_with_quick, positive_int, temperature
from dspark_jax.build import (add_model_arguments, build_engine, cache_capacity, load_drafter_for, load_target,
                              target_name)
from dspark_jax.engine import parse_policy
from dspark_jax.plots import plot_serving
from dspark_jax.serving import (closed_loop, interleaved, mixed_prompts, pooled_ratio, scheduling_quality,
                                window_tokens)
from dspark_jax.sharding import mesh_from_args
from dspark_jax.io import check_writable
from dspark_jax.sps import SPSTable, default_sps_table, load_sps_table
from dspark_jax.timing import device_info, format_table, write_json

FIXED = ("fixed:1", "fixed:3", "fixed:7")
# A second `none` engine (--control): its ratio to `none` is what the benchmark measures for two identical
# engines, the noise floor of every ratio at that point.
CONTROL = "none-control"


def engine_policy(text: str):
    """The engine policy a benchmark policy name stands for (the control runs plain decoding)."""
    return parse_policy("none" if text == CONTROL else text)


# What a resumed run must share with the interrupted one for their rows to belong to one measurement.
_SAME = ("concurrency", "temperatures", "policies", "thresholds", "threshold_sweep_at", "max_new_tokens",
         "max_prompt_tokens", "warmup_rounds", "rounds", "repeats", "min_window_tokens", "draft", "sps", "prompts",
         "seed", "sequential", "quick", "model", "prerun")


def settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("resume", "recompute")}


def previous_rows(args) -> list[dict]:
    """The rows of an interrupted run at ``args.json`` (none if the file does not exist), after checking that it
    ran with the same settings."""
    path = Path(args.json)
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
        rows, before = old["rows"], old["args"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: {path} is not a bench_serving report ({e})") from e
    now = settings(args)
    differ = [k for k in _SAME if before.get(k) != now.get(k)]
    if differ:
        raise ValueError(f"--resume: {path} was measured with other settings ("
                         + ", ".join(f"{k}={before.get(k)!r}, now {now.get(k)!r}" for k in differ)
                         + "); use another --json or the same settings")
    return rows


def add_ratios(point: list[dict], *, paired: bool) -> None:
    """The ratios of every row of one (concurrency, temperature) point against `none` and the best fixed K,
    in place. Interleaved (``paired``): the best fixed K is the one with the highest throughput over all
    windows (``tokens_per_s_pooled``), and each row gets its per-window ratios, their median (``_paired``),
    the ratio over all windows (``_pooled``) and its paired bootstrap interval (``_ci``). Sequential: the
    best fixed K and the ratios by the median windows only."""
    speed = "tokens_per_s_pooled" if paired else "tokens_per_s"
    for r in point:
        if paired:
            r["tokens_per_s_pooled"] = sum(r["window_emitted"]) / sum(r["window_seconds"])
    none = next((r for r in point if r["policy"] == "none"), None)
    fixed = [r for r in point if r["policy"].startswith("fixed:")]
    best_fixed = max(fixed, key=lambda r: r[speed]) if fixed else None
    for r in point:
        r["best_fixed"] = best_fixed["policy"] if best_fixed else None
        for key, ref in (("ratio_vs_none", none), ("ratio_vs_best_fixed", best_fixed)):
            r[key] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None  # the ratio of the medians
            if not paired:
                continue
            # window k of every policy ran side by side: the per-window ratios, and their median (a host-speed
            # drift between windows cancels inside each window; the ratio of the medians does not pair them)
            r[key + "_repeats"] = [a / b for a, b in zip(r["repeats"], ref["repeats"])] if ref else None
            r[key + "_paired"] = float(np.median(r[key + "_repeats"])) if ref else None
            # throughput over all windows against the reference's over the same windows (the same answers), with
            # a paired bootstrap 95% interval over the windows
            pooled = (pooled_ratio(r["window_emitted"], r["window_seconds"], ref["window_emitted"],
                                   ref["window_seconds"]) if ref else (None, None, None))
            r[key + "_pooled"], r[key + "_ci"] = pooled[0], (list(pooled[1:]) if ref else None)


def recompute(path: str) -> list[dict]:
    """The ratios of the report at ``path`` recomputed by :func:`add_ratios` (this version's rules, on the
    windows it recorded; nothing is measured), written back atomically."""
    report = json.loads(Path(path).read_text())
    rows = report["rows"]
    points: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r.get("threshold_sweep"):
            points.setdefault((r["concurrency"], r["temperature"]), []).append(r)
    paired = not report["args"].get("sequential")
    for point in points.values():
        add_ratios(point, paired=paired)
    write_json(path, dict(report, rows=rows))
    return [r for point in points.values() for r in point]


def paired_ratios(row: dict) -> str:
    """A row's pooled ratios against `none` and the best fixed K with their intervals and the median of the
    per-window ratios, for the printout."""
    out = ""
    for key, ref in (("none", "none"), ("best_fixed", row.get("best_fixed"))):
        ci = row.get(f"ratio_vs_{key}_ci")
        if ci:
            out += (f"  / {ref} {row[f'ratio_vs_{key}_pooled']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
                    f" (median {row[f'ratio_vs_{key}_paired']:.3f})")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="concurrency 1 and 16, T = 0, three policies, short windows (< 1 min); options given "
                        "explicitly keep their values")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plots", metavar="DIR", help="write the PNG figures into this folder")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--temperatures", type=temperature, nargs="+", default=[0.0, 1.0])
    p.add_argument("--policies", nargs="+", default=["none", *FIXED, "threshold", "dspark", "dspark-async"],
                   help="'threshold' means threshold:C at the best C of a sweep of --thresholds at one concurrency")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    p.add_argument("--threshold-sweep-at", type=positive_int, metavar="N",
                   help="concurrency of the threshold sweep (default: the middle of --concurrency)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    p.add_argument("--warmup-rounds", type=nonnegative_int, default=6,
                   help="warm-up before the windows: what this many plain-decoding rounds emit (N tokens each)")
    p.add_argument("--rounds", type=positive_int, default=24,
                   help="window length in plain-decoding rounds: every policy's window ends after rounds x N "
                        "emitted tokens, so window k of every policy serves the same prompts")
    p.add_argument("--repeats", type=positive_int, default=3, help="measurement windows per point")
    p.add_argument("--min-window-tokens", type=positive_int, default=96,
                   help="at least this many tokens per window (low concurrency)")
    add_model_arguments(p)
    p.add_argument("--sps", help="SPS table JSON (default: the shipped CPU table)")
    p.add_argument("--prompts", help="folder of JSONL prompts (default: ../shared/data/prompts/dev or shipped)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="the engines' prefix cache (off by default: the closed loop cycles through the same prompts, "
                        "which a cache would serve instead of prefilling; profiling.bench_prefix measures it)")
    p.add_argument("--sequential", action="store_true",
                   help="measure each policy's windows back to back (default: policies interleaved round by round)")
    p.add_argument("--prerun", action=argparse.BooleanOptionalAction, default=True,
                   help="run every point once untimed, then again on fresh engines for the timing (default): "
                        "XLA:CPU generates the machine code of a program's branch at its first execution, which "
                        "jax does not report as a compile, so a round that first takes a path (a probe, a "
                        "scheduler stage) costs 3-6x a steady one; the first run takes every path the timed run "
                        "will take. --no-prerun (the default of --quick): time the first run (half the time; "
                        "such rounds counted)")
    p.add_argument("--control", action="store_true",
                   help=f"add a second `none` engine ({CONTROL!r}) to every point: its ratio to `none` is the "
                        "noise floor of the ratios (two identical engines)")
    p.add_argument("--recompute", action="store_true",
                   help="measure nothing: recompute the ratios of the report at --json by this version's rules "
                        "(from the windows it recorded), write it back and draw --plots")
    p.add_argument("--resume", action="store_true",
                   help="keep the points (and threshold sweeps) already in --json from an interrupted run with the "
                        "same settings, and measure only the rest")
    args = parse_with_quick(p, argv, concurrency=[1, 16], temperatures=[0.0], policies=["none", "fixed:3", "dspark"],
                            max_new_tokens=48, warmup_rounds=3, rounds=6, repeats=2, min_window_tokens=12, prerun=False)
    if args.control and CONTROL not in args.policies:
        args.policies = [*args.policies, CONTROL]
    if args.recompute:
        if not args.json:
            raise ValueError("--recompute needs --json: the report to recompute")
        shown = recompute(args.json)
        for r in shown:
            print(f"  T={r['temperature']:g} N={r['concurrency']:3d} {r['policy']:14s}{paired_ratios(r)}")
        if args.plots:
            plot_serving(shown, args.plots)
        return shown
    if args.resume and not args.json:
        raise ValueError("--resume needs --json: the file of the interrupted run")
    # every option checked before the model loads and the first point is measured
    for text in args.policies:
        if text != "threshold":
            try:
                engine_policy(text)
            except ValueError as e:
                p.error(f"--policies: {e}")
    bad = [c for c in args.thresholds if not 0.0 <= c <= 1.0]
    if bad:
        p.error(f"--thresholds: expected confidences in [0, 1], got {bad}")
    if args.prompts and not Path(args.prompts).is_dir():
        p.error(f"--prompts {args.prompts}: expected a folder of JSONL prompt files")
    if args.sps:
        try:
            SPSTable.load(args.sps)
        except ValueError as e:
            p.error(f"--sps: {e}")
    if args.json and not args.resume:
        try:
            check_writable(args.json)
        except ValueError as e:
            p.error(f"--json: {e}")
    done = previous_rows(args) if args.resume else []

    t_start = time.perf_counter()
    mesh = mesh_from_args(args)
    model = load_target(args.model, dtype=args.dtype, mesh=mesh)
    loaded = load_drafter_for(model, args.draft)
    name = target_name(args.model)
    table = load_sps_table(args.sps, model=name, block=7) if args.sps else default_sps_table(model=name)
    prompts = [ids for _, ids in mixed_prompts(model.tokenizer, args.prompts, max_prompt_tokens=args.max_prompt_tokens,
                                              seed=args.seed)]
    capacity = cache_capacity(args.max_prompt_tokens, args.max_new_tokens, loaded.drafter.cfg.block)
    info = device_info()
    rows, recorded = list(done), {}

    def save(complete):
        """The rows so far, written atomically after every point: an interrupted run keeps what it measured
        (``--resume`` goes on from there)."""
        if args.json:
            write_json(args.json, {"rows": rows, "complete": complete, "args": settings(args),
                                   "wall_seconds": time.perf_counter() - t_start})

    def engine_for(policy_text, n, temp):
        policy = engine_policy(policy_text)
        engine = build_engine(model, str(policy), draft=loaded, sps=table, num_slots=n, capacity=capacity,
                              temperature=temp, seed=args.seed, mesh=mesh,
                              enable_prefix_caching=args.enable_prefix_caching)
        engine.record_confidences = policy.drafts
        return engine

    def sizes(n):
        return dict(warmup_tokens=args.warmup_rounds * n,
                    window_tokens=window_tokens(n, args.rounds, args.min_window_tokens), repeats=args.repeats)

    def measure(policy_text, n, temp):
        if args.prerun:  # the same run untimed first: every program and branch it takes compiled and generated
            closed_loop(engine_for(policy_text, n, temp), prompts, n, args.max_new_tokens, **sizes(n))
        engine = engine_for(policy_text, n, temp)
        res = closed_loop(engine, prompts, n, args.max_new_tokens, **sizes(n))
        return report(policy_text, n, temp, res, engine)

    def measure_interleaved(policies, n, temp):
        """Every policy's loop warmed up, then the windows, the policies stepping one round each in turn (after
        the same run untimed on other engines of the same settings, with ``--prerun``)."""
        if args.prerun:
            interleaved({pol: engine_for(pol, n, temp) for pol in policies}, prompts, n, args.max_new_tokens,
                        **sizes(n))
        engines = {pol: engine_for(pol, n, temp) for pol in policies}
        res = interleaved(engines, prompts, n, args.max_new_tokens, **sizes(n))
        return [report(pol, n, temp, res[pol], engines[pol]) for pol in policies]

    def report(policy_text, n, temp, res, engine):
        policy = engine_policy(policy_text)
        row = {"policy": policy_text, "concurrency": n, "temperature": temp, "tokens_per_s": res.tokens_per_s,
               "tokens_per_s_spread": res.tokens_per_s_spread, "tokens_per_s_per_user": res.tokens_per_s / n,
               "window_emitted": res.window_emitted, "window_seconds": res.window_seconds,
               "accept_len": res.accept_len, "drafts_per_request": res.drafts_per_request,
               "rejected_share": res.rejected_share, "mean_batch_tokens": res.mean_batch_tokens,
               "repeats": res.repeats, "steady_rounds": res.steady_rounds, "compiled_rounds": res.compiled_rounds,
               # the learned cut-off (GateConfig.off_after): [round, row bucket] where the drafter was
               # switched off, and the requests admitted with and without the drafter's context
               "drafter_offs": [list(x) for x in engine.drafter_offs], "admissions": dict(engine.admissions)}
        print(f"  T={temp:g} N={n:3d} {policy_text:14s} {res.tokens_per_s:8.1f} tok/s (+-{res.tokens_per_s_spread:.1f})"
              f"  accept {res.accept_len:.2f}  drafts/req {res.drafts_per_request:.2f}"
              + (f"  drafter off at rounds {[r for r, _ in engine.drafter_offs]}" if engine.drafter_offs else ""),
              flush=True)
        if policy.drafts:  # every drafted round of every drafting policy at this load is a test case
            recorded.setdefault((n, temp), []).extend(r for r in res.rounds if r.drafted)
        return row

    for temp in args.temperatures:
        best_c, sweep = None, []
        if "threshold" in args.policies:
            # A small sweep of C at one concurrency picks the threshold used at every concurrency.
            n0 = args.threshold_sweep_at or args.concurrency[len(args.concurrency) // 2]
            sweep = [r for r in done if r.get("threshold_sweep") and r["temperature"] == temp]
            if not sweep:
                sweep = [measure(f"threshold:{c:g}", n0, temp) for c in args.thresholds]
                for r in sweep:
                    r.update(info, threshold_sweep=True)
                rows += sweep
                save(False)
                jax.clear_caches()
            best = max(sweep, key=lambda r: r["tokens_per_s"])
            best_c = best["policy"]
            print(f"  T={temp:g}: best threshold at N={n0}: {best_c}", flush=True)
        for n in args.concurrency:
            if any(r["concurrency"] == n and r["temperature"] == temp and not r.get("threshold_sweep") for r in done):
                print(f"  T={temp:g} N={n:3d}: kept from {args.json}", flush=True)
                continue
            point = []
            if args.sequential:
                for pol in args.policies:
                    if pol == "threshold":
                        r = best if best["concurrency"] == n else measure(best_c, n, temp)
                        point.append(dict(r, policy="threshold:best", threshold=best_c, threshold_sweep=False))
                    else:
                        point.append(measure(pol, n, temp))
            else:
                names = [best_c if pol == "threshold" else pol for pol in args.policies]
                for pol, r in zip(args.policies, measure_interleaved(names, n, temp)):
                    point.append(dict(r, policy="threshold:best", threshold=best_c, threshold_sweep=False)
                                 if pol == "threshold" else r)
            add_ratios(point, paired=not args.sequential)
            for r in point:
                r.update(info)
            rows += point
            save(False)
            # Every point compiles its own programs (its row count, buckets, windows); a run of every load and
            # temperature in one process otherwise keeps them all and runs out of memory maps (an LLVM
            # "Cannot allocate memory" at the 10th of 14 points, 2026-12-01).
            jax.clear_caches()
    wall = time.perf_counter() - t_start
    shown = [r for r in rows if not r.get("threshold_sweep")]
    print()
    print(f"{info['backend']} / {info['device_kind']} / {info['host']} / jax {info['jax_version']}; "
          f"max_new_tokens {args.max_new_tokens}, {len(prompts)} prompts, wall {wall:.0f} s")
    print(format_table(shown, ["temperature", "concurrency", "policy", "tokens_per_s", "tokens_per_s_spread",
                               "tokens_per_s_per_user", "accept_len", "drafts_per_request", "rejected_share",
                               "ratio_vs_none", "ratio_vs_best_fixed"]
                             + ([] if args.sequential else ["ratio_vs_none_paired", "ratio_vs_best_fixed_paired"])))
    if not args.sequential:
        print("\nratios over all windows [paired bootstrap 95% interval] (median of the per-window ratios):")
        for r in shown:
            print(f"  T={r['temperature']:g} N={r['concurrency']:3d} {r['policy']:14s}{paired_ratios(r)}")
    q = {f"N={n} T={t:g}": scheduling_quality(v, table) for (n, t), v in recorded.items()}
    if q:
        print("\nscheduling quality (expected throughput of first drop / best point of the greedy path, on the "
              "confidences of every drafted round at that load, all drafting policies):")
        for k, v in q.items():
            print(f"  {k}: {json.dumps(v)}")
    if args.json:
        write_json(args.json, {"rows": rows, "complete": True, "scheduling_quality": q, "wall_seconds": wall,
                               "args": settings(args),
                               **({"resumed_points": len([r for r in done if not r.get("threshold_sweep")])}
                                  if done else {})})
    if args.plots:
        plot_serving(shown, args.plots)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
