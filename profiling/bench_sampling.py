"""The blocked two-level Gumbel draw (``dspark_jax.sampling.categorical``) against ``jax.random.categorical``.

    python -m profiling.bench_sampling [--quick] [--json PATH]

For every (rows, categories): one jitted draw of a token per row with a key per row, by the one-level Gumbel
draw (a variate per category) and by the blocked one, timed in turns in one run; the ratio is one-level /
blocked. The categories are a target vocabulary (SmolLM2's 49 152 by default) and a draft vocabulary (8192):
the sizes the data generator, plain decoding, verification's next token and the drafter's draws sample from.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from dspark_jax.sampling import categorical
from dspark_jax.timing import device_info, format_table, time_call, write_json


@jax.jit
def one_level(keys, logits):
    return jax.vmap(jax.random.categorical)(keys, logits)


def bench_one(rows: int, categories: int, repeats: int, rounds: int) -> dict:
    keys = jax.random.split(jax.random.key(rows), rows)
    logits = jax.random.normal(jax.random.key(categories), (rows, categories)) * 3.0
    one, blocked = [], []
    for _ in range(rounds):  # in turns, so a drift of the host's speed hits both sides alike
        one.append(time_call(lambda: one_level(keys, logits), repeats=repeats, warmup=1).median)
        blocked.append(time_call(lambda: categorical(keys, logits), repeats=repeats, warmup=1).median)
    t_one, t_blocked = float(np.median(one)), float(np.median(blocked))
    return {"rows": rows, "categories": categories, "one_level_ms": t_one * 1e3, "blocked_ms": t_blocked * 1e3,
            "one_level_over_blocked": t_one / t_blocked}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (under a minute)")
    p.add_argument("--vocab", type=int, default=49152, help="the target's vocabulary size")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the drafter's vocabulary size")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    for name in ("vocab", "draft_vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive number of categories, "
                    f"got {getattr(args, name)}")

    row_counts = (1, 4, 16, 64)
    repeats, rounds = 10, 3
    if args.quick:
        row_counts, repeats, rounds = (1, 16, 64), 5, 2
    info = device_info()
    rows = []
    for categories in (args.vocab, args.draft_vocab):
        for r in row_counts:
            row = bench_one(r, categories, repeats, rounds)
            rows.append({**row, **info})
            print(f"rows {r:3d}  categories {categories:6d}  one-level {row['one_level_ms']:8.3f} ms  "
                  f"blocked {row['blocked_ms']:7.3f} ms  ratio {row['one_level_over_blocked']:6.2f}", flush=True)
    print()
    print(f"{info['backend']} / {info['device_kind']} / {info['host']} / jax {info['jax_version']}")
    print(format_table(rows, ["rows", "categories", "one_level_ms", "blocked_ms", "one_level_over_blocked"]))
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
