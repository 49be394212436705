"""Fit Sequential Temperature Scaling for a drafter on rounds decoded from dev prompts (calibration half).

    python -m train.calibrate --draft runs/dspark/export --prompts ../shared/data/prompts/dev
    python -m train.calibrate --draft dspark --out runs/dspark-calibrated   # a shipped drafter: --out needed

Fits one set of STS temperatures per sampling temperature (``--temperatures``, default 0 and 1: a draft survives
by the target's argmax at 0 and by rejection sampling above, so the same confidence means a different chance;
each request then uses the set fitted nearest its own temperature), each temperature with a logit offset beside it
(``--no-offsets``: the paper's temperatures alone). Writes sts.json, calibration.json and
reliability.png beside the drafter weights, or, with --out FOLDER, a copy
of the drafter folder with them (what --draft FOLDER then loads). It never writes into the installed package:
a shipped drafter (or any folder inside the package or site-packages) needs --out elsewhere.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from dspark_jax import calibration
from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.sharding import mesh_from_args
from dspark_jax.drafters import (SHIPPED, copy_drafter, drafter_source, installed_package_path, resolve_drafter,
                                 shipped_dir)
from dspark_jax.evaluation import encode_first_turns, evaluate_rounds, fixed_block_rounds, half_per_file, pooled
from dspark_jax.plots import plot_reliability
from dspark_jax.timing import write_json
from dspark_jax.cli import nonnegative_int, positive_int, temperature


def output_folder(draft: str, out: str | None) -> Path:
    """Where the calibration goes: ``out``, else the drafter's own folder; never inside the installed package.

    Raises:
      ValueError: naming --out when the destination lies inside the installed package.
    """
    folder = shipped_dir(draft) if draft in SHIPPED else Path(draft)
    if out is None:
        if installed_package_path(folder):
            raise ValueError(f"--draft {draft}: the drafter lives in the installed package ({folder}), which "
                             f"calibration never writes into; pass --out FOLDER (it gets a copy of the drafter "
                             f"with its calibration, loadable as --draft FOLDER)")
        return folder
    if installed_package_path(out):
        raise ValueError(f"--out {out}: lies inside the installed package or site-packages; choose a folder "
                         f"of your own")
    return Path(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="dspark | dflash | a drafter folder")
    p.add_argument("--out", help="folder for the calibrated drafter (default: the drafter's own folder, which "
                                 "must not be in the installed package)")
    add_model_arguments(p, draft=False)
    p.add_argument("--prompts", nargs="+", default=["../shared/data/prompts/dev"])
    p.add_argument("--limit", type=positive_int, default=24, help="prompts per file from the calibration half")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=640)
    p.add_argument("--temperatures", type=temperature, nargs="+", default=[0.0, 1.0],
                   help="sampling temperatures to fit a set at (each request uses the set fitted nearest its own)")
    p.add_argument("--offsets", action=argparse.BooleanOptionalAction, default=True,
                   help="fit a logit offset per position beside each STS temperature (calibration.fit_sts_bias); "
                        "--no-offsets fits the paper's temperatures alone")
    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--seed", type=nonnegative_int, default=1)
    args = p.parse_args(argv)
    at = sorted(set(args.temperatures))
    try:
        drafter_source(args.draft)
        out = output_folder(args.draft, args.out)
        chosen_per_file = half_per_file(sorted(args.prompts), "calib", args.limit)  # checks the files first
    except (ValueError, OSError) as e:
        p.error(str(e))
    mesh = mesh_from_args(args)
    model = load_target(args.model, dtype=args.dtype, mesh=mesh)
    drafter, _, _, path = resolve_drafter(args.draft, target_cfg=model.cfg)
    if args.out is None:  # the folder the drafter was actually loaded from, checked again
        out = output_folder(str(path), None)
    prompts = encode_first_turns(model.tokenizer, chosen_per_file, args.max_prompt_tokens)
    fitted, offsets, reports = [], [], []
    for t in at:
        rounds, _ = fixed_block_rounds(model, drafter, prompts, max_new_tokens=args.max_new_tokens, mesh=mesh,
                                       temperature=t, concurrency=args.concurrency, seed=args.seed)
        logits, acc, ver = pooled(rounds)
        if args.offsets:
            temps, bias = calibration.fit_sts_bias(logits, acc, ver)
        else:
            temps, bias = calibration.fit_sts(logits, acc, ver), np.zeros(drafter.cfg.block, np.float32)
        fitted.append(temps)
        offsets.append(bias)
        reports.append(evaluate_rounds(rounds, drafter.cfg.block, temps, bias if args.offsets else None))
        print(f"T = {t:g}: " + json.dumps({k: reports[-1][k] for k in ("accept_len", "rounds", "ece_raw", "ece_sts",
                                                                       "auroc")}))
        print("  temperatures:", [round(float(x), 3) for x in fitted[-1]])
        if args.offsets:
            print("  offsets:", [round(float(x), 3) for x in offsets[-1]])
    sets = calibration.STSSets(np.asarray(at), np.stack(fitted), np.stack(offsets))
    info = [{"rounds": r["rounds"], "prompts": len(prompts), "half": "calib", "model": args.model} for r in reports]
    # calibration.json: the report at the highest temperature at the top (what `drafters.prior_confidence`
    # reads), every temperature's summary under "sets"
    report = {**reports[-1], "temperature": at[-1],
              "sets": [{"temperature": t, **{k: r[k] for k in ("accept_len", "rounds", "ece_raw", "ece_sts", "auroc",
                                                                "temperatures", "per_position", "reliability_raw",
                                                                "reliability_sts")}}
                       for t, r in zip(at, reports)]}
    same = out.absolute().resolve() == Path(path).absolute().resolve()
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        stage = Path(path) if same else Path(tmp)  # in place for the drafter's own folder, else staged
        calibration.save_sts(stage / "sts.json", sets, info)
        write_json(stage / "calibration.json", report)
        curves = [{"label": f"{kind}, T = {t:g}", **r[f"reliability_{kind}"]}
                  for t, r in zip(at, reports) for kind in ("raw", "sts")]
        plot_reliability(curves, stage / "reliability.png",
                         title=f"{out.name}: pooled survival, {sum(r['rounds'] for r in reports)} rounds")
        if not same:
            copy_drafter(path, out, attach=[stage / n for n in ("sts.json", "calibration.json", "reliability.png")])
    print(f"calibrated drafter: {out}")


if __name__ == "__main__":
    main()
