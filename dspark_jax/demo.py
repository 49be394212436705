"""End-to-end demo of the default set-up: the target, the shipped DSpark drafter and SPS table.

    python -m dspark_jax.demo [--model GGUF|HF_FOLDER --draft DRAFTER] [--dtype auto]

1. Answers a few prompts (math, code, chat) with streaming output, speculative decoding with the `dspark`
   policy, and prints the speed and accepted length of each.
2. Measures closed-loop throughput at low and high load (1 and 16 concurrent users) for plain decoding
   (`none`), the best fixed block length K and `dspark`, and prints the table with ratios.
"""

from __future__ import annotations

import argparse
import sys
import time

from dspark_jax.build import (add_model_arguments, build_engine, cache_capacity, load_drafter_for, load_target,
                              target_name)
from dspark_jax.sharding import mesh_from_args
from dspark_jax.serving import interleaved, mixed_prompts, shipped_prompts_dir, window_tokens
from dspark_jax.sps import default_sps_table
from dspark_jax.timing import device_info, format_table
from dspark_jax.cli import positive_int


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=positive_int, default=12,
                   help="window length in plain-decoding rounds (rounds x N emitted tokens, the same for every policy)")
    # A window at one user holds at least one answer's budget: 12 rounds there are 12 tokens, and a window of a few
    # dozen tokens times a part of one answer (the rotation's first, a chat one), not the mix of domains the
    # table stands for; three windows serve a chat, a math and a code answer.
    p.add_argument("--min-window-tokens", type=positive_int, default=None,
                   help="at least this many tokens per window (default: --max-new-tokens)")
    p.add_argument("--repeats", type=positive_int, default=3, help="windows per policy, the policies taking turns")
    p.add_argument("--skip-table", action="store_true")
    add_model_arguments(p)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    mesh = mesh_from_args(args)
    model = load_target(args.model, dtype=args.dtype, mesh=mesh)
    loaded = load_drafter_for(model, args.draft)
    drafter, path = loaded.drafter, loaded.path
    sps = default_sps_table(model=target_name(args.model))
    tok = model.tokenizer
    prompts = mixed_prompts(tok, shipped_prompts_dir(), max_prompt_tokens=256)
    G = drafter.cfg.block
    capacity = cache_capacity(256, args.max_new_tokens, G)
    info = device_info()
    cpu = sps.metadata.extra.get("cpu") or {}
    measured_on = " ".join(x for x in (cpu.get("model_name") or cpu.get("vendor"), cpu.get("isa")) if x)
    print(f"target {target_name(args.model)} ({info['backend']}, {info['host']}), drafter {path.name} "
          f"(G={G}, {drafter.cfg.head} head), SPS table up to B={sps.max_tokens} measured {sps.metadata.date} on "
          f"{measured_on or sps.metadata.device_kind}\n")

    engine = build_engine(model, "dspark", draft=loaded, sps=sps, num_slots=1, capacity=capacity, mesh=mesh)
    seen = set()
    for domain, ids in prompts:
        if domain in seen:
            continue
        seen.add(domain)
        text = tok.decode(ids, skip_special=True)
        text = text.split("user\n", 1)[-1].rsplit("assistant", 1)[0].strip()  # the user turn of the template
        print(f"### [{domain}] {text[:300]}")
        stream = tok.stream()
        engine.on_token = lambda _, t: (sys.stdout.write(stream.push(t)), sys.stdout.flush())
        start = len(engine.rounds)
        (done,) = engine.run([ids], args.max_new_tokens)
        sys.stdout.write(stream.flush() + "\n")
        rounds = engine.rounds[start:]
        secs = sum(r.seconds for r in rounds)
        acc = sum(int(r.accepted.sum()) + r.active for r in rounds) / max(sum(r.active for r in rounds), 1)
        print(f"--- {len(done.output_ids)} tokens in {secs:.2f} s ({len(done.output_ids) / secs:.1f} tokens/s incl. "
              f"any compilation), accepted length {acc:.2f}\n")
    if args.skip_table:
        return
    print("closed-loop throughput (policies taking turns round by round, tokens over seconds of all windows: window "
          "k of every policy serves the same answers; rounds that compiled are excluded):")
    rows = []
    min_window = args.max_new_tokens if args.min_window_tokens is None else args.min_window_tokens
    ids_only = [ids for _, ids in prompts]
    policies = ("none", "fixed:1", "fixed:3", "fixed:7", "dspark")
    for n in args.concurrency:
        engines = {pol: build_engine(model, pol, draft=loaded, sps=sps, num_slots=n, capacity=capacity, mesh=mesh)
                   for pol in policies}
        results = interleaved(engines, ids_only, n, args.max_new_tokens, warmup_tokens=4 * n,
                              window_tokens=window_tokens(n, args.rounds, min_window),
                              repeats=args.repeats)
        point = []
        for pol in policies:
            res = results[pol]
            pooled = sum(res.window_emitted) / sum(res.window_seconds)  # the mix, not its middle window
            point.append({"concurrency": n, "policy": pol, "tokens_per_s": pooled,
                          "accept_len": res.accept_len, "drafts_per_request": res.drafts_per_request})
            print(f"  N={n:3d} {pol:8s} {pooled:7.1f} tokens/s", flush=True)
        base = point[0]["tokens_per_s"]
        best = max(point[1:4], key=lambda r: r["tokens_per_s"])
        best = dict(best, policy=f"best fixed ({best['policy']})")
        for r in (point[0], best, point[4]):
            rows.append(dict(r, ratio_vs_none=r["tokens_per_s"] / base))
    print()
    print(format_table(rows, ["concurrency", "policy", "tokens_per_s", "ratio_vs_none", "accept_len",
                              "drafts_per_request"]))
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s; {info['host']}, jax {info['jax_version']})")


if __name__ == "__main__":
    main()
