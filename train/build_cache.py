"""Build the target cache (tapped hidden states, final hidden states, log-partitions) of generated data.

    python -m train.build_cache --data data/responses --out runs/data/cache
    python -m train.build_cache --data data/responses --out runs/data/val_cache --shards 80:85   # held out
    python -m train.build_cache --out runs/data/cache --shards 0:9,10:24      # every shard but 9

A cache folder holds the shards it was last built with: shards already cached there are kept, not computed
again, so a cache can be extended by naming its old shards and the new ones.
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
    p.add_argument("--shards", default=None, metavar="START:STOP[,START:STOP...]",
                   help="only shards START..STOP-1 of --data (e.g. 0:80 to train, 80:85 to validate; several "
                        "ranges joined by commas, 0:9,10:24); default all")
    add_model_arguments(p, draft=False)
    args = p.parse_args(argv)
    shards = None
    if args.shards is not None:
        shards = []
        for part in args.shards.split(","):
            try:
                start, stop = (int(x) for x in part.split(":"))
            except ValueError:
                p.error(f"--shards {args.shards}: {part!r} is not START:STOP; expected two integers (e.g. 0:80), "
                        f"ranges joined by commas")
            if not 0 <= start < stop:
                p.error(f"--shards {args.shards}: {part!r}: expected 0 <= START < STOP")
            shards.extend(range(start, stop))
        if len(set(shards)) != len(shards):
            p.error(f"--shards {args.shards}: the ranges overlap; expected each shard at most once")
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
