"""Scheduler cost against a bare stable argsort of the same values and against the Python loop.

    python -m profiling.bench_scheduler [--quick] [--json PATH]

For every (R, G): the scheduler's cost per call inside a jitted ``fori_loop`` (no dispatch overhead)
and as a single jitted call, a bare ``jnp.argsort(stable=True, descending=True)`` of the same R*G
survival values in the same kind of loop, and Algorithm 1 as a plain Python loop.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dspark_jax import scheduler
from dspark_jax.timing import device_info, format_table, time_call, write_json

TABLE_TOKENS = 2048  # the synthetic table covers batches up to this many tokens


def synthetic_sps(n_tokens: int) -> np.ndarray:
    """A CPU-like curve: steps/s falls steeply above a few dozen tokens per step."""
    b = np.arange(n_tokens + 1, dtype=np.float64)
    return (1.0 / (0.05 * (1.0 + np.maximum(b, 1) / 48.0))).astype(np.float32)


def drafter_like_confidences(rng, rows, block):
    return rng.beta(4.0, 1.0, size=(rows, block)).astype(np.float32)


def in_loop_cost(fn, conf, iters, repeats):
    """Seconds per iteration of ``fn(conf_i) -> scalar`` inside one jitted fori_loop."""

    @jax.jit
    def loop(c):
        def body(i, acc):
            ci = c * (1.0 - i.astype(jnp.float32) * 1e-6)  # new values every iteration
            return acc + fn(ci)

        return lax.fori_loop(0, iters, body, jnp.float32(0))

    return time_call(lambda: loop(conf), repeats=repeats, warmup=1).median / iters


def bench_one(rows, block, sps, rng, iters, repeats):
    conf = jnp.asarray(drafter_like_confidences(rng, rows, block))
    sps_j = jnp.asarray(sps)

    def sched(c):
        return jnp.sum(scheduler.schedule(c, sps_j).lengths).astype(jnp.float32)

    def sched_argmax(c):
        return jnp.sum(scheduler.schedule(c, sps_j, stop="argmax").lengths).astype(jnp.float32)

    def bare_argsort(c):
        a = scheduler.survival_probs(c).reshape(-1)
        return jnp.argsort(a, stable=True, descending=True)[0].astype(jnp.float32)

    t_sched = in_loop_cost(sched, conf, iters, repeats)
    t_argmax = in_loop_cost(sched_argmax, conf, iters, repeats)
    t_sort = in_loop_cost(bare_argsort, conf, iters, repeats)
    single = time_call(lambda: scheduler.schedule(conf, sps_j), repeats=max(repeats, 5) * 4, warmup=2).median
    conf_np = np.asarray(conf)
    t0 = time.perf_counter()
    loops = 0
    while loops < 3 or time.perf_counter() - t0 < 0.2:
        scheduler.algorithm1_loop(conf_np, sps)
        loops += 1
    t_py = (time.perf_counter() - t0) / loops
    admitted = int(scheduler.schedule(conf, sps_j).batch_tokens) - rows
    return {
        "R": rows,
        "G": block,
        "table_tokens": int(sps.shape[0] - 1),
        "admitted": admitted,
        "schedule_us": t_sched * 1e6,
        "schedule_argmax_us": t_argmax * 1e6,
        "schedule_call_us": single * 1e6,
        "argsort_us": t_sort * 1e6,
        "ratio_to_argsort": t_sched / t_sort,
        "python_us": t_py * 1e6,
        "python_over_schedule": t_py / t_sched,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (under a minute)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    shapes = [(r, g) for r in (8, 64, 256, 1024) for g in (4, 7, 16)]
    iters, repeats = 200, 5
    if args.quick:
        shapes = [(8, 7), (64, 7), (256, 16), (1024, 16)]
        iters, repeats = 50, 3
    sps = synthetic_sps(TABLE_TOKENS)
    rng = np.random.default_rng(args.seed)
    info = device_info()
    rows = []
    for r, g in shapes:
        row = bench_one(r, g, sps, rng, iters, repeats)
        rows.append({**row, **info})
        print(f"R={r:5d} G={g:3d}  schedule {row['schedule_us']:9.1f} us  argsort {row['argsort_us']:9.1f} us  "
              f"ratio {row['ratio_to_argsort']:.3f}  python {row['python_us']:10.1f} us", flush=True)
    print()
    print(f"{info['backend']} / {info['device_kind']} / {info['host']} / jax {info['jax_version']}; "
          f"synthetic table up to B={TABLE_TOKENS}, drafter-like confidences (Beta(4, 1))")
    print(format_table(rows, ["R", "G", "admitted", "schedule_us", "schedule_argmax_us", "schedule_call_us",
                              "argsort_us", "ratio_to_argsort", "python_us", "python_over_schedule"]))
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
