"""Generate drafter training data: the target answers the training prompts itself (resumable).

    python -m train.generate_data --prompts ../shared/data/prompts/train --out runs/data/responses --max-prompts 1152
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.sharding import mesh_from_args
from dspark_jax.data import generate_responses, load_prompts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", default=["../shared/data/prompts/train"],
                   help="JSONL files or folders of training prompts (never dev/)")
    p.add_argument("--out", default="runs/data/responses")
    add_model_arguments(p, draft=False)
    p.add_argument("--limit", type=int, default=None, help="prompts per file")
    p.add_argument("--max-prompts", type=int, default=None,
                   help="use the first N prompts after shuffling (the shipped drafters used 1152: 12 chunks)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 1.0],
                   help="sampling temperature of each chunk, in turn (0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=24)
    p.add_argument("--chunk", type=int, default=96, help="prompts per resumable chunk")
    p.add_argument("--shuffle-seed", type=int, default=0,
                   help="prompts are shuffled with this seed so that every prefix of chunks mixes the domains")
    args = p.parse_args(argv)
    for path in args.prompts:
        if "dev" in Path(path).resolve().parts:
            p.error(f"--prompts {path}: dev prompts are for evaluation only; never train on them")
    prompts = load_prompts(args.prompts, limit=args.limit)
    order = np.random.default_rng(args.shuffle_seed).permutation(len(prompts))
    prompts = [prompts[i] for i in order][: args.max_prompts]
    if mesh_from_args(args) is not None:
        p.error("--tensor-parallel-size / --data-parallel-size: this command runs on one device")
    model = load_target(args.model, dtype=args.dtype)
    files = generate_responses(model, prompts, args.out, max_new_tokens=args.max_new_tokens,
                               temperatures=args.temperatures, seed=args.seed, num_slots=args.slots,
                               chunk_size=args.chunk, max_prompt_tokens=args.max_prompt_tokens)
    print(f"{len(files)} chunks in {args.out}")


if __name__ == "__main__":
    main()
