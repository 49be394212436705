"""Build the target cache (tapped hidden states, final hidden states, log-partitions) of generated data.

    python -m train.build_cache --data runs/data/responses --out runs/data/cache
"""

from __future__ import annotations

import argparse

from dspark_jax.data import build_target_cache, load_chunks
from dspark_jax.models.llama import LlamaModel


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="runs/data/responses")
    p.add_argument("--out", default="runs/data/cache")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    chunks = load_chunks(args.data)
    model = LlamaModel.from_gguf(args.model)
    build_target_cache(model, chunks, args.out)
    print(f"{sum(len(c) for c in chunks.values())} sequences in {len(chunks)} shards cached in {args.out}")


if __name__ == "__main__":
    main()
