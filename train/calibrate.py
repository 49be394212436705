"""Fit Sequential Temperature Scaling for a drafter on rounds decoded from dev prompts (calibration half).

    python -m train.calibrate --draft runs/dspark/export --prompts ../shared/data/prompts/dev

Writes sts.json beside the drafter weights, plus calibration.json and reliability.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_jax import calibration
from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.data import load_prompts
from dspark_jax.drafters import resolve_drafter
from dspark_jax.evaluation import evaluate_rounds, fixed_block_rounds, pooled, split_half
from dspark_jax.plots import plot_reliability
from dspark_jax.timing import write_json


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, draft=False)
    p.add_argument("--draft", required=True, help="drafter folder (sts.json is written into it)")
    p.add_argument("--prompts", nargs="+", default=["../shared/data/prompts/dev"])
    p.add_argument("--limit", type=int, default=24, help="prompts per file from the calibration half")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=640)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    model = load_target(args.model, dtype=args.dtype)
    drafter, _, _, path = resolve_drafter(args.draft, target_cfg=model.cfg)
    prompts = []
    for f in sorted(Path(x) for x in args.prompts):
        files = sorted(f.glob("*.jsonl")) if f.is_dir() else [f]
        for g in files:
            chosen = split_half(load_prompts([g]), "calib")[: args.limit]
            prompts += [ids for ids in (model.tokenizer.encode_chat([pr.turns[0]]) for pr in chosen)
                        if len(ids) <= args.max_prompt_tokens]
    rounds, _ = fixed_block_rounds(model, drafter, prompts, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, concurrency=args.concurrency, seed=args.seed)
    logits, acc, ver = pooled(rounds)
    temps = calibration.fit_sts(logits, acc, ver)
    report = evaluate_rounds(rounds, drafter.cfg.block, temps)
    calibration.save_temperatures(path / "sts.json", temps, {"rounds": report["rounds"], "prompts": len(prompts),
                                                               "temperature": args.temperature, "half": "calib"})
    write_json(path / "calibration.json", report)
    plot_reliability([{"label": "raw", **report["reliability_raw"]}, {"label": "STS", **report["reliability_sts"]}],
                     path / "reliability.png", title=f"{path.name}: pooled survival, {report['rounds']} rounds")
    print(json.dumps({k: report[k] for k in ("accept_len", "rounds", "ece_raw", "ece_sts", "auroc")}, indent=1))
    print("temperatures:", [round(float(t), 3) for t in temps])


if __name__ == "__main__":
    main()
