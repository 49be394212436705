"""A burst of long prompts arriving while streams decode: how long the running streams wait between tokens.

    python -m profiling.bench_burst [--quick] [--json out.json] [--policy dspark] [--budget 64]

``--streams`` requests decode (answers of set length, stop ids ignored); after ``--warm-steps`` steps a burst of
``--burst`` prompts of about ``--prompt-tokens`` tokens arrives at once. For each running stream, its
inter-token gaps (wall time between the steps in which it emitted) before the burst and while the burst is
prefilled and joins; the figure is the largest gap during the burst over the median gap before it. Two engines
run the same scenario in this process, one after the other: prompts prefilled within ``--budget`` tokens a step
(`EngineConfig.max_num_batched_tokens`) and whole at admission (no budget, the engine before mixed steps). A
warm-up run of the scenario compiles first; ``compiles`` counts what the timed run still compiled (a program the
drafter gate had not chosen before, each a stall of seconds on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np

from dspark_jax.build import add_model_arguments, build_engine, load_target
from dspark_jax.cli import parse_with_quick, positive_int, writable_file
from dspark_jax.engine import SamplingParams
from dspark_jax.gate import GateConfig
from dspark_jax.timing import compile_count, device_info, format_table, write_json


def long_prompt(tokenizer, n: int, seed: int) -> list[int]:
    """About ``n`` tokens of text (a numbered list), different per seed."""
    words = [f"item {seed}.{i}: the quick brown fox jumps over the lazy dog." for i in range(n)]
    return tokenizer.encode_chat([" ".join(words)])[-n:]


def run_scenario(engine, streams: list[list[int]], burst: list[list[int]], *, answer: int, warm_steps: int
                 ) -> dict[str, float]:
    """Gaps of the running streams (seconds) before and during the burst."""
    sampling = SamplingParams(ignore_eos=True)
    compiles = compile_count()
    ids = [engine.submit(p, answer, sampling) for p in streams]
    last = {}
    before, during = [], []
    burst_ids: list[int] = []
    step = 0
    while not engine.idle():
        counts = {i: len(engine.requests[i].output_ids) for i in ids}
        engine.step()
        now = time.perf_counter()
        for i in ids:
            if i in engine.finished_ids or len(engine.requests[i].output_ids) == counts[i]:
                continue
            if i in last:
                (during if burst_ids else before).append(now - last[i])
            last[i] = now
        step += 1
        if step == warm_steps:
            burst_ids = [engine.submit(p, 4, sampling) for p in burst]
        if burst_ids and all(i in engine.finished_ids for i in burst_ids):
            break
    for i in ids + burst_ids:
        if i not in engine.finished_ids:
            engine.cancel(i)
    if not before or not during:
        raise RuntimeError("the scenario ended before the burst: raise --answer or lower --warm-steps")
    median = float(np.median(before))
    return {"median_gap_before_ms": 1e3 * median, "max_gap_during_ms": 1e3 * max(during),
            "p50_gap_during_ms": 1e3 * float(np.median(during)), "max_over_median": max(during) / median,
            "compiles": compile_count() - compiles}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--quick", action="store_true", help="2 streams, a burst of 2 prompts of 160 tokens")
    p.add_argument("--json", type=writable_file, help="write the rows here (checked before the benchmark)")
    p.add_argument("--policy", default="dspark")
    p.add_argument("--budget", type=positive_int, default=64, help="max_num_batched_tokens of the budgeted engine")
    p.add_argument("--streams", type=positive_int, default=4)
    p.add_argument("--burst", type=positive_int, default=8)
    p.add_argument("--prompt-tokens", type=positive_int, default=900)
    p.add_argument("--answer", type=positive_int, default=400, help="tokens each stream decodes")
    p.add_argument("--warm-steps", type=positive_int, default=24, help="steps before the burst arrives")
    args = parse_with_quick(p, argv, streams=2, burst=2, prompt_tokens=160, answer=100, warm_steps=8)

    target = load_target(args.model, dtype=args.dtype)
    tok = target.tokenizer
    streams = [tok.encode_chat([f"Write a long story about the number {i}."]) for i in range(args.streams)]
    burst = [long_prompt(tok, args.prompt_tokens, seed) for seed in range(args.burst)]
    slots = args.streams + args.burst
    rows = []
    for budget in (args.budget, None):
        # the round-time correction off: the timed run then takes the warm-up run's decisions (and programs); no
        # prefix cache, which would serve the repeated burst from the warm-up's pages
        engine = build_engine(target, args.policy, draft=args.draft, num_slots=slots,
                              max_prompt_tokens=args.prompt_tokens, max_new_tokens=args.answer,
                              max_num_batched_tokens=budget, gate=GateConfig(calibrate_times=False),
                              enable_prefix_caching=False)  # the timed run repeats the warm-up's prompts
        run_scenario(engine, streams, burst, answer=args.answer, warm_steps=args.warm_steps)  # compiles
        result = run_scenario(engine, streams, burst, answer=args.answer, warm_steps=args.warm_steps)
        rows.append({"policy": args.policy, "max_num_batched_tokens": budget or "none", **result})
        print(f"budget {budget}: {result}", flush=True)
    print(format_table(rows, ["policy", "max_num_batched_tokens", "median_gap_before_ms", "p50_gap_during_ms",
                              "max_gap_during_ms", "max_over_median", "compiles"]))
    if args.json:
        write_json(args.json, {"device": device_info(), "date": datetime.datetime.now().isoformat(timespec="minutes"),
                               "args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows})


if __name__ == "__main__":
    main()
