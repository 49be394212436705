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

from dspark_jax import export
from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.evaluation import encode_chosen
from dspark_jax.timing import write_json
from train.evaluate import add_decoding_arguments, chosen_prompts, decode_and_report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m train.check_export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)  # --model, --dtype, --draft
    add_decoding_arguments(p)  # --prompts, --limit, --half, --max-new-tokens, --temperature, --seed, ...
    p.add_argument("--format", required=True, choices=export.FORMATS)
    p.add_argument("--verifier", help="speculators: the target's Hugging Face id or path, recorded in the config")
    p.add_argument("--out", required=True, help="folder for the export and check.json")
    args = p.parse_args(argv)
    chosen = chosen_prompts(p, args)
    out = Path(args.out)
    folder = out / args.format
    export.main(["--format", args.format, args.draft, str(folder)] + (["--model", args.model] if args.model else [])
                + (["--verifier", args.verifier] if args.verifier else []))
    model = load_target(args.model, dtype=args.dtype)
    prompts = [ids for _, _, ids in encode_chosen(model.tokenizer, chosen, args.max_prompt_tokens)]
    first, first_out, _, first_path = decode_and_report(model, args.draft, prompts, args)
    again, again_out, _, _ = decode_and_report(model, str(folder), prompts, args)
    differ = [i for i, (a, b, x, y) in enumerate(zip(first["per_request"], again["per_request"], first_out, again_out))
              if a != b or x != y]
    result = {"draft": str(first_path), "format": args.format, "export": str(folder), "prompts": len(prompts),
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
