"""One decoding round, stage by stage, beside the target's weights-only floor and a plain round.

    python -m profiling.bench_round [--quick] [--json out.json] [--model PATH] [--users 1 4 16]

For each number of users (requests decoded together): the drafter's layers, the LM head over the draft
vocabulary, the sequential and confidence heads, the whole draft program, the schedule, the drafter's
context write, one host round trip, the verification of 1, 2, 4 and 8 tokens per request and the
weights-only floor at the same token counts, each its own program, timed in turns in this process
(`dspark_jax.stages.round_stage_rows`); then whole engine rounds (``none`` and ``fixed:1/3/7``, a random
drafter of the shipped shape) and a ``dspark`` engine whose drafter gate stays shut (the packaged SPS table's
cost model: what a drafting engine pays in a round it does not draft) stepped in turns. Ratios are to the plain
round and to the floor at one token per user, all measured in this run.
"""

from __future__ import annotations

import argparse
import datetime

from dspark_jax.build import add_model_arguments, load_target, target_name
from dspark_jax.measure import random_drafter
from dspark_jax.sps import default_sps_table
from dspark_jax.stages import round_stage_rows
from dspark_jax.timing import device_info, format_table, write_json
from dspark_jax.cli import positive_int, writable_file


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, draft=False)
    p.add_argument("--quick", action="store_true",
                   help="one user, verification of 1, 4, 8 tokens, rounds none and fixed:3/7, fewer repeats")
    p.add_argument("--json", type=writable_file, help="write the rows and the device description here (checked "
                                                       "before the benchmark, not after it)")
    p.add_argument("--users", type=positive_int, nargs="+", help="numbers of users (default 1 4 16; quick: 1)")
    p.add_argument("--context", type=positive_int, default=140, help="tokens each request holds")
    args = p.parse_args(argv)

    target = load_target(args.model, dtype=args.dtype)
    drafter = random_drafter(target.cfg)
    users = args.users or ((1,) if args.quick else (1, 4, 16))
    quick = dict(verify_tokens=(1, 4, 8), drafts=(3, 7), repeats=3, rounds=4) if args.quick else {}
    rows = round_stage_rows(target, drafter, users=users, context=args.context,
                            **{**dict(repeats=7, rounds=12), **quick}, warmup=2, progress=print,
                            sps=default_sps_table(model=target_name(args.model)))
    print(format_table(rows, ["users", "stage", "ms", "of_plain_round", "of_floor", "tokens", "rest_ms"]))
    if args.json:
        write_json(args.json, {"device": device_info(), "date": datetime.date.today().isoformat(),
                               "dtype": str(target.dtype), "quick": args.quick, "context": args.context,
                               "rows": rows})


if __name__ == "__main__":
    main()
