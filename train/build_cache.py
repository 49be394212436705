"""Build the target cache (tapped hidden states, final hidden states, log-partitions) of generated data.

    python -m train.build_cache --data data/responses --out runs/data/cache
    python -m train.build_cache --data data/responses --out runs/data/val_cache --shards 80:85   # held out
"""

from __future__ import annotations

import argparse

from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.sharding import mesh_from_args
from dspark_jax.data import build_target_cache
from dspark_jax.datagen import load_responses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/responses")
    p.add_argument("--out", default="runs/data/cache")
    p.add_argument("--shards", default=None, metavar="START:STOP",
                   help="only shards START..STOP-1 of --data (e.g. 0:80 to train, 80:85 to validate); default all")
    add_model_arguments(p, draft=False)
    args = p.parse_args(argv)
    shards = None
    if args.shards is not None:
        try:
            start, stop = (int(x) for x in args.shards.split(":"))
        except ValueError:
            p.error(f"--shards {args.shards}: expected START:STOP, two integers (e.g. 0:80)")
        if not 0 <= start < stop:
            p.error(f"--shards {args.shards}: expected 0 <= START < STOP")
        shards = range(start, stop)
    try:
        chunks = load_responses(args.data, shards=shards)
    except ValueError as e:
        p.error(str(e))
    if mesh_from_args(args) is not None:
        p.error("--tensor-parallel-size / --data-parallel-size: this command runs on one device")
    model = load_target(args.model, dtype=args.dtype)
    build_target_cache(model, chunks, args.out)
    print(f"{sum(len(c) for c in chunks.values())} sequences in {len(chunks)} shards cached in {args.out}")


if __name__ == "__main__":
    main()
