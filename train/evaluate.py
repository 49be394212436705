"""Evaluate a drafter: speculative decoding of prompts at a fixed block length.

    python -m train.evaluate --draft dspark --prompts ../shared/data/prompts/dev/gsm8k.jsonl --limit 40 \
        --max-new-tokens 128 --temperature 1 --json runs/eval_gsm8k.json

Reports the accepted length tau (bonus included, pooled over rounds), per-position survival and conditional
acceptance, and calibration (ECE over 20 bins, AUROC, Brier; raw and after STS when the drafter has STS
temperatures). `--half eval` keeps the odd-numbered prompts (the even ones are the calibration half). The JSON
also holds each prompt's rounds and accepted drafts (`per_request`), which `train.summarize_eval` uses for
intervals over prompts and to cut a report to a smaller `--limit`.
"""

from __future__ import annotations

import argparse

from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.calibration import STSSets
from dspark_jax.sharding import mesh_from_args
from dspark_jax.drafters import drafter_source, resolve_drafter
from dspark_jax.evaluation import encode_chosen, evaluate_rounds, fixed_block_rounds, half_per_file
from dspark_jax.timing import write_json
from dspark_jax.cli import nonnegative_int, positive_int, temperature, writable_file


def add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    """The prompt and decoding options of a fixed-block evaluation (this command's, `train.check_export`'s)."""
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL files or folders")
    p.add_argument("--limit", type=positive_int, help="prompts per file (after --half)")
    p.add_argument("--half", default="eval", choices=["all", "calib", "eval"],
                   help="which half of each file (alternate prompts): eval (default), the half `train.calibrate` "
                        "never fits on; calib; all")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=640)
    p.add_argument("--temperature", type=temperature, default=1.0)
    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--seed", type=nonnegative_int, default=0)


def chosen_prompts(p: argparse.ArgumentParser, args) -> list[list]:
    """The prompts `add_decoding_arguments` chose, per file (`half_per_file`), with ``--draft`` checked too: bad
    paths, prompt lines or drafter folders stop the command (``p.error``) before any model loads."""
    try:
        chosen = half_per_file(args.prompts, args.half, args.limit)
        drafter_source(args.draft)
    except (ValueError, OSError) as e:
        p.error(str(e))
    return chosen


def decode_and_report(model, draft: str, prompts, args, *, mesh=None, use_sts: bool = True, labels=None):
    """Decode ``prompts`` with the drafter ``draft`` verifying the whole block every round (``args``: the
    `add_decoding_arguments` options) and report its acceptance and calibration (`evaluate_rounds`, with the STS set
    the engine used at this temperature: a drafter may carry sets fitted at several). Returns (report, each request's
    emitted tokens in prompt order, the drafter, its folder)."""
    drafter, _, temps, path = resolve_drafter(draft, target_cfg=model.cfg)
    temps = temps if use_sts else None
    rounds, engine = fixed_block_rounds(model, drafter, prompts, max_new_tokens=args.max_new_tokens, mesh=mesh,
                                        temperature=args.temperature, concurrency=args.concurrency, seed=args.seed,
                                        sts_temperatures=temps)
    sets = None if temps is None else STSSets.of(temps)
    used = (None, None) if sets is None else (sets.for_temperature(args.temperature),
                                              sets.biases_for_temperature(args.temperature))
    report = evaluate_rounds(rounds, drafter.cfg.block, *used, labels=labels)
    outputs = [list(map(int, engine.requests[i].output_ids)) for i in range(len(prompts))]
    return report, outputs, drafter, path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)  # --model, --dtype, --draft
    add_decoding_arguments(p)
    p.add_argument("--no-sts", action="store_true", help="ignore the drafter's STS temperatures")
    p.add_argument("--json", metavar="OUT", type=writable_file)  # checked before the decoding, not after it
    args = p.parse_args(argv)
    chosen_per_file = chosen_prompts(p, args)
    mesh = mesh_from_args(args)
    model = load_target(args.model, dtype=args.dtype, mesh=mesh)
    kept = encode_chosen(model.tokenizer, chosen_per_file, args.max_prompt_tokens)
    prompts = [ids for _, _, ids in kept]
    # each request's rounds, labelled [file, position among the file's chosen prompts]: `summarize_eval --first N`
    # cuts a report to the prompts `--limit N` would have chosen
    report, _, drafter, path = decode_and_report(model, args.draft, prompts, args, mesh=mesh, use_sts=not args.no_sts,
                                                 labels=[[f, i] for f, i, _ in kept])
    report.update(draft=str(path), model=args.model, prompts=len(prompts), temperature=args.temperature,
                  max_new_tokens=args.max_new_tokens, block=drafter.cfg.block, half=args.half,
                  prompts_over_limit=sum(map(len, chosen_per_file)) - len(prompts))  # dropped: > --max-prompt-tokens
    print(f"{path.name}: {len(prompts)} prompts of the {args.half} half ({report['prompts_over_limit']} over "
          f"--max-prompt-tokens {args.max_prompt_tokens} left out), tau {report['accept_len']:.3f} over "
          f"{report['rounds']} rounds, "
          f"ECE raw {report['ece_raw']:.4f}"
          + (f", ECE STS {report['ece_sts']:.4f}" if report["ece_sts"] is not None else "")
          + f", AUROC {report['auroc']:.3f}")
    print("survival per position: " + " ".join(f"{r['survival']:.3f}" for r in report["per_position"]))
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
