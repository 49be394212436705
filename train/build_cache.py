"""Build the target cache (tapped hidden states, final hidden states, log-partitions) of generated data.

    python -m train.build_cache --data runs/data/responses --out runs/data/cache
"""

from __future__ import annotations

import argparse

from dspark_jax.data import build_target_cache, load_sequences
from dspark_jax.models.llama import LlamaModel


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="runs/data/responses")
    p.add_argument("--out", default="runs/data/cache")
    p.add_argument("--model", default=None)
    p.add_argument("--shard-tokens", type=int, default=200_000)
    args = p.parse_args(argv)
    seqs = load_sequences(args.data)
    model = LlamaModel.from_gguf(args.model)
    build_target_cache(model, seqs, args.out, shard_tokens=args.shard_tokens)
    print(f"{len(seqs)} sequences cached in {args.out}")


if __name__ == "__main__":
    main()
