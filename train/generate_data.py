"""Generate drafter training data: the target answers every training prompt several times (resumable by shard).

    python -m train.generate_data                                  # SmolLM2: every training prompt, 5 answers each
    python -m train.generate_data --max-shards 4                   # stop after 4 more shards (resume later)
    python -m train.generate_data --model QWEN3_FOLDER --out runs/qwen3/responses

Each prompt (first turn, chat template, at most --max-prompt-tokens) is answered once per --samples entry, at that
temperature (0 = greedy), with continuous batching over --slots slots and the prompt prefilled once. Shards of
--shard-prompts prompts are written atomically as compressed token ids (`dspark_jax.datagen`); a restarted run
skips the shards on disk, and refuses an --out made with other settings. Progress and tokens/s go to stdout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dspark_jax.build import add_model_arguments, load_target, target_name
from dspark_jax.data import load_prompts
from dspark_jax.datagen import generate_responses
from dspark_jax.sharding import mesh_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.generate_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", default=["../shared/data/prompts/train"],
                   help="JSONL files or folders of training prompts (never dev/)")
    p.add_argument("--out", default="data/responses", help="the shards' folder")
    add_model_arguments(p, draft=False)
    p.add_argument("--limit", type=int, default=None, help="prompts per file")
    p.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts after shuffling")
    p.add_argument("--samples", type=float, nargs="+", default=[0.0, 1.0, 1.0, 1.0, 1.0],
                   help="the temperature of each answer to a prompt (0 = greedy)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=64, help="answers decoded together")
    p.add_argument("--shard-prompts", type=int, default=32, help="prompts per resumable shard")
    p.add_argument("--max-shards", type=int, default=None, help="write at most this many shards in this run")
    p.add_argument("--shuffle-seed", type=int, default=0,
                   help="prompts are shuffled with this seed so that every prefix of shards mixes the domains")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the per-shard lines remain)")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for path in args.prompts:
        if "dev" in Path(path).resolve().parts:
            p.error(f"--prompts {path}: dev prompts are for evaluation only; never train on them")
    if mesh_from_args(args) is not None:
        p.error("--tensor-parallel-size / --data-parallel-size: this command runs on one device")
    if any(t < 0 for t in args.samples):
        p.error(f"--samples: temperatures must be >= 0, got {args.samples}")
    for name in ("max_new_tokens", "max_prompt_tokens", "slots", "shard_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        prompts = load_prompts(args.prompts, limit=args.limit)
    except ValueError as e:
        p.error(str(e))
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out}: a file; expected a folder (new, or one this command started: it resumes)")
    order = np.random.default_rng(args.shuffle_seed).permutation(len(prompts))
    prompts = [prompts[i] for i in order][: args.max_prompts]
    model = load_target(args.model, dtype=args.dtype)
    try:
        summary = generate_responses(model, prompts, args.out, temperatures=args.samples,
                                     max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                                     num_slots=args.slots, shard_prompts=args.shard_prompts, seed=args.seed,
                                     model_name=target_name(args.model), max_shards=args.max_shards,
                                     progress=not args.no_progress, log=lambda m: print(m, flush=True))
    except ValueError as e:
        p.error(str(e))
    print(f"{summary['shards']} shards written to {args.out}: {summary['tokens']} answer tokens in "
          f"{summary['seconds']:.0f} s ({summary['tokens_per_s']:.1f} tokens/s)")


if __name__ == "__main__":
    main()
