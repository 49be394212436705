"""Check an exported drafter against its original: export, read back, decode the same prompts with both.

    python -m train.check_export --draft dspark --format speculators --prompts ../shared/data/prompts/dev \
        --half eval --limit 10 --temperature 1 --out runs/export_check

Writes ``--draft`` in ``--format`` (`dspark_jax.export`) to ``OUT/<format>``, reads it back as any ``--draft``
folder is read, and decodes the chosen prompts with the original and with the read-back drafter (policy fixed:G,
the whole block verified every round, as `train.evaluate` does), same seed, same draws. A faithful export gives
every request the same rounds, the same accepted drafts in each and the same tokens: the command prints both
accepted lengths and the requests that differ, writes ``OUT/check.json`` and exits with status 1 when any does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from dspark_jax import export
from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.calibration import STSSets
from dspark_jax.cli import nonnegative_int, positive_int, temperature
from dspark_jax.drafters import drafter_source, resolve_drafter
from dspark_jax.evaluation import encode_chosen, evaluate_rounds, fixed_block_rounds, half_per_file
from dspark_jax.timing import write_json


def decode(model, source: str, prompts, args) -> tuple[dict, list[list[int]], str]:
    """(the evaluation report, each request's emitted tokens, the drafter's folder) of one drafter."""
    drafter, _, temps, path = resolve_drafter(source, target_cfg=model.cfg)
    rounds, engine = fixed_block_rounds(model, drafter, prompts, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, concurrency=args.concurrency, seed=args.seed,
                                        sts_temperatures=temps)
    sets = None if temps is None else STSSets.of(temps)
    used = (None, None) if sets is None else (sets.for_temperature(args.temperature),
                                              sets.biases_for_temperature(args.temperature))
    report = evaluate_rounds(rounds, drafter.cfg.block, *used)
    outputs = [list(map(int, engine.requests[i].output_ids)) for i in range(len(prompts))]
    return report, outputs, str(path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m train.check_export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)  # --model, --dtype, --draft
    p.add_argument("--format", required=True, choices=export.FORMATS)
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL files or folders")
    p.add_argument("--half", default="eval", choices=["all", "calib", "eval"])
    p.add_argument("--limit", type=positive_int, help="prompts per file (after --half)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=640)
    p.add_argument("--temperature", type=temperature, default=1.0)
    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--verifier", help="speculators: the target's Hugging Face id or path, recorded in the config")
    p.add_argument("--out", required=True, help="folder for the export and check.json")
    args = p.parse_args(argv)
    try:
        chosen = half_per_file(args.prompts, args.half, args.limit)
        drafter_source(args.draft)
    except (ValueError, OSError) as e:
        p.error(str(e))
    out = Path(args.out)
    folder = out / args.format
    export.main(["--format", args.format, args.draft, str(folder)] + (["--model", args.model] if args.model else [])
                + (["--verifier", args.verifier] if args.verifier else []))
    model = load_target(args.model, dtype=args.dtype)
    prompts = [ids for _, _, ids in encode_chosen(model.tokenizer, chosen, args.max_prompt_tokens)]
    first, first_out, first_path = decode(model, args.draft, prompts, args)
    again, again_out, _ = decode(model, str(folder), prompts, args)
    differ = [i for i, (a, b, x, y) in enumerate(zip(first["per_request"], again["per_request"], first_out, again_out))
              if a != b or x != y]
    result = {"draft": first_path, "format": args.format, "export": str(folder), "prompts": len(prompts),
              "temperature": args.temperature, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
              "accept_len": first["accept_len"], "accept_len_export": again["accept_len"],
              "rounds": first["rounds"], "rounds_export": again["rounds"],
              "tokens": int(sum(map(len, first_out))), "requests_that_differ": differ}
    write_json(out / "check.json", result)
    print(f"{first_path} -> {folder} ({args.format}): {len(prompts)} prompts at T = {args.temperature:g}, seed "
          f"{args.seed}: tau {first['accept_len']:.4f} over {first['rounds']} rounds, read back "
          f"{again['accept_len']:.4f} over {again['rounds']}; {len(differ)} of {len(prompts)} requests differ "
          f"(rounds, accepted drafts or tokens)")
    if differ:
        print(f"requests that differ: {differ[:20]}", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
