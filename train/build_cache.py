"""Build the target cache (tapped hidden states, final hidden states, log-partitions) of generated data.

    python -m train.build_cache --data data/responses --out runs/data/cache
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
    p.add_argument("--max-shards", type=int, default=None, help="only the first N shards of --data")
    add_model_arguments(p, draft=False)
    args = p.parse_args(argv)
    if args.max_shards is not None and args.max_shards < 1:
        p.error(f"--max-shards {args.max_shards}: expected an integer >= 1")
    chunks = load_responses(args.data, max_shards=args.max_shards)
    if mesh_from_args(args) is not None:
        p.error("--tensor-parallel-size / --data-parallel-size: this command runs on one device")
    model = load_target(args.model, dtype=args.dtype)
    build_target_cache(model, chunks, args.out)
    print(f"{sum(len(c) for c in chunks.values())} sequences in {len(chunks)} shards cached in {args.out}")


if __name__ == "__main__":
    main()
