"""What a closed drafter gate costs: the drafter's share of rounds that draft nothing.

    python -m profiling.bench_closed_gate [--quick] [--rows 8 32] [--pairs 40] [--json out.json]

A `dspark` engine whose gate never opens still keeps the drafter ready: the verify program of every plain
round writes the drafter's context K/V for the committed tokens (from the target's tapped layers), a small
program decides the next round's gate, and a joining request's prefill writes the drafter's context for its
prompt. This script measures each against the same work without the drafter, on one engine's state:

- `verify`: the verify-and-commit program of a plain round (one token per request, no drafts) with the
  context write (`drafting=True`, what a closed-gate round runs) and without it (`drafting=False`, what
  `none` runs), the two taking turns on the same state, `--pairs` pairs per row count;
- `gate`: the gate's program after each round (`_after_round`);
- `prefill`: a prompt of `--prompt-tokens` tokens prefilled in chunks with and without the drafter's context
  write, taking turns.

Printed and written (`--json`) as medians in ms with the ratio with / without; the ratio is the cost of a
closed gate as a share of the round. Compilation is excluded (each program runs once first).
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.drafters import resolve_drafter
from dspark_jax.engine import Engine, EngineConfig, _after_round, _pow2, _verify_and_commit, _window
from dspark_jax.models.llama import LlamaModel, bucket_for
from dspark_jax.sps import default_sps_table
from dspark_jax.timing import device_info, format_table, write_json


def new_tokens(pairs: int) -> int:
    """Each request's budget: every verify call commits one token per row, so rows stay active throughout."""
    return 2 * pairs + 16


def _paired(run_a, run_b, pairs: int) -> tuple[float, float]:
    """Median seconds of ``run_a`` and ``run_b`` (each returns its own seconds), alternating which goes first."""
    a, b = [], []
    for i in range(pairs):
        if i % 2 == 0:
            a.append(run_a())
            b.append(run_b())
        else:
            b.append(run_b())
            a.append(run_a())
    return float(np.median(a)), float(np.median(b))


def closed_gate_costs(model: LlamaModel, drafter, temps, rows: int, pairs: int, prompt_tokens: int,
                      capacity: int) -> list[dict]:
    """Rows of the report for one row count (see the module docstring)."""
    cfg = EngineConfig(num_slots=rows, capacity=capacity, temperature=0.0, gate_margin=1e9,
                       gate_probe_every=10**9, calibrate_times=False, drafter_off_after=None)  # the gate kept closed
    eng = Engine(model, drafter, "dspark", cfg, sts_temperatures=temps, sps=default_sps_table())
    text = "Explain, step by step, how a hash map handles collisions and what that costs. " * 40
    ids = model.tokenizer.encode(text)[:prompt_tokens]
    for _ in range(rows):
        eng.submit(ids, new_tokens(pairs))
    while (eng.slot_request >= 0).sum() < rows or eng.pending:
        eng.step()
    if eng.idle():
        raise RuntimeError("every request finished during admission")
    R, T, G = _pow2(rows, rows), bucket_for(rows), eng.G
    longest = int(eng.slot_length.max()) + pairs * 2 + 8
    if longest + G + 1 > capacity:
        raise ValueError(f"capacity {capacity} too small for {pairs} pairs after a {prompt_tokens}-token prompt")
    window = _window(longest + G + 1, capacity, cfg.window_rule)
    temp, stop = jnp.float32(0.0), jnp.asarray(eng.stop_ids)
    conf0, drafted0 = eng._round_conf(None, R)

    def verify(drafting: bool):
        def run():
            t = time.perf_counter()
            eng.state, out = _verify_and_commit(
                model.weights, eng.state, None, conf0 if drafting else None, drafted0 if drafting else None,
                eng.d_graph if drafting else None, eng.d_state if drafting else None,
                eng.draft_vocab if drafting else None, temp, stop, seed=0, cfg=model.cfg, R=R, T=T, G=G,
                window=window, greedy=True, drafting=drafting, per_slot=1)
            jax.block_until_ready(out)
            return time.perf_counter() - t
        return run

    def gate():
        t = time.perf_counter()
        jax.block_until_ready(_after_round(eng.cost, eng._time_scale_dev, eng.state, jnp.int32(rows),
                                           jnp.int32(longest), jnp.int32(rows), jnp.bool_(False), R=R,
                                           probe_every=cfg.gate_probe_every, probe_budget=cfg.gate_probe_budget,
                                           fill=cfg.fill_buckets, margin=cfg.gate_margin))
        return time.perf_counter() - t

    def prefill_run(write: bool):
        def run():
            st = eng.state
            t = time.perf_counter()
            _, cache, dcache = eng._prefill_caches(st.cache, st.dcache, 0, ids, write_context=write)
            jax.block_until_ready((cache, dcache))
            elapsed = time.perf_counter() - t
            eng.state = st.replace(cache=cache, dcache=dcache)  # slot 0's prompt rewritten in place
            return elapsed
        return run

    for f in (verify(True), verify(False), gate, prefill_run(True), prefill_run(False)):
        f()  # compile
    with_s, without_s = _paired(verify(True), verify(False), pairs)
    gate_s = float(np.median([gate() for _ in range(pairs)]))
    pre_with, pre_without = _paired(prefill_run(True), prefill_run(False), max(2, pairs // 4))
    return [
        {"measure": "verify", "rows": rows, "with_drafter_ms": 1e3 * with_s, "without_ms": 1e3 * without_s,
         "ratio": with_s / without_s},
        {"measure": "gate", "rows": rows, "with_drafter_ms": 1e3 * gate_s, "without_ms": 0.0,
         "ratio": (without_s + gate_s) / without_s},
        {"measure": "prefill", "rows": rows, "prompt_tokens": len(ids), "with_drafter_ms": 1e3 * pre_with,
         "without_ms": 1e3 * pre_without, "ratio": pre_with / pre_without},
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="active requests (plain rounds)")
    p.add_argument("--pairs", type=int, default=40, help="alternating pairs per measurement")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--draft", default="dspark", help="drafter name or folder")
    p.add_argument("--quick", action="store_true", help="4 rows, 8 pairs, 64-token prompts (under a minute)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.pairs, args.prompt_tokens = [4], 8, 64
    for name in ("pairs", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if any(r < 1 for r in args.rows):
        raise SystemExit(f"--rows: expected integers >= 1, got {args.rows}")
    model = LlamaModel.from_gguf()
    drafter, _, temps, _ = resolve_drafter(args.draft, target_cfg=model.cfg)
    need = args.prompt_tokens + new_tokens(args.pairs) + drafter.cfg.block + 1
    capacity = -(-need // 128) * 128
    rows = []
    for r in args.rows:
        rows += closed_gate_costs(model, drafter, temps, r, args.pairs, args.prompt_tokens, capacity)
    print(format_table(rows, ["measure", "rows", "with_drafter_ms", "without_ms", "ratio"]))
    if args.json:
        write_json(args.json, {"rows": rows, "device": device_info(), "date": datetime.date.today().isoformat(),
                               "args": vars(args)})
    return rows


if __name__ == "__main__":
    main()
