"""Write a drafter in another engine's checkpoint format: vLLM speculators or DeepSpec.

    python -m dspark_jax.export --format speculators DRAFTER OUT [--model TARGET] [--verifier HF_ID]
    python -m dspark_jax.export --format deepspec DRAFTER OUT [--model TARGET] [--mask-token-id ID] [--widen-vocab]

DRAFTER is whatever ``--draft`` takes: a shipped name (``dspark``, ``dflash``), one of our drafter folders, a DeepSpec
or a speculators checkpoint folder. ``speculators`` (``models.speculators``) is what vLLM serves
(``--speculative-config '{"method": "dspark", "model": OUT, ...}'``); ``deepspec`` (``models.deepspec``) is
DeepSpec's ``Qwen3DSparkModel`` folder, for DeepSpec's own evaluator and the engines that read it.

What the format cannot express is refused, naming the drafter's fields, before the target loads. The target
(``--model``, default SmolLM2-135M-Instruct) is loaded only when the format needs its embedding or LM head: a
DeepSpec folder stores both, a speculators folder the LM head rows of a reduced draft vocabulary, and a drafter's
own copies are checked to be the target's. ``sts.json`` and ``calibration.json`` are copied beside the weights:
neither format has a field for them; this package reads them back, other engines ignore them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dspark_jax.cli import model_path, nonnegative_int
from dspark_jax.drafters import installed_package_path, resolve_drafter
from dspark_jax.heads import convert_drafter
from dspark_jax.models.deepspec import check_drafter_fits, deepspec_refusals, save_deepspec_drafter
from dspark_jax.models.speculators import save_speculators_drafter, speculators_refusals

FORMATS = ("speculators", "deepspec")
CALIBRATION_FILES = ("sts.json", "calibration.json")
STORE_DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=FORMATS, help="the checkpoint format to write")
    p.add_argument("drafter", help="dspark | dflash | a drafter folder (ours, DeepSpec or speculators)")
    p.add_argument("out", help="the folder to write (replaced atomically if it exists)")
    p.add_argument("--model", type=model_path, help="the target: a GGUF file or a Hugging Face checkpoint folder "
                                                    "(default: the embedded SmolLM2-135M-Instruct GGUF), loaded "
                                                    "only when the format needs its embedding or LM head")
    p.add_argument("--verifier", help="speculators: the target's Hugging Face id or path, recorded in the config "
                                      "(speculators' own classes rebuild the embedding from it)")
    p.add_argument("--mask-token-id", type=nonnegative_int,
                   help="deepspec: the unused token row that takes a learned mask vector")
    p.add_argument("--store-dtype", choices=STORE_DTYPES, help="the stored dtype (default: the drafter's)")
    p.add_argument("--widen-vocab", action="store_true",
                   help="write a drafter of a reduced draft vocabulary as one proposing from the full vocabulary "
                        "(DeepSpec's only kind): the LM head takes every target row, the Markov head's new tokens "
                        "start as its out-of-vocabulary ones did; its drafts can differ from the original's "
                        "(check them: python -m train.check_export), the output stays lossless either way")
    return p


def _architectures(model: str | None) -> list[str]:
    """A Hugging Face target folder's ``architectures`` (what speculators records of its verifier), else []."""
    cfg = Path(model) / "config.json" if model else None
    if cfg is None or not cfg.is_file():
        return []
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    return [str(a) for a in archs]


def main(argv: list[str] | None = None) -> Path:
    p = build_parser()
    args = p.parse_args(argv)
    out = Path(args.out)
    if installed_package_path(out):
        p.error(f"{out}: inside the installed package; choose a folder of your own")
    try:
        drafter, _, _, source = resolve_drafter(args.drafter)
    except ValueError as err:
        p.error(str(err))
    cfg = drafter.cfg
    if args.widen_vocab and cfg.draft_vocab < cfg.vocab_size:
        try:
            drafter = convert_drafter(drafter, dataclasses.replace(cfg, draft_vocab_size=0),
                                      vocab_ids=np.arange(cfg.vocab_size)).drafter
        except ValueError as err:
            p.error(f"--widen-vocab: {err}")
        print(f"--widen-vocab: the draft vocabulary widened from {cfg.draft_vocab} to all {cfg.vocab_size} tokens; "
              f"this is a different drafter, whose drafts can differ from {args.drafter}'s", file=sys.stderr)
        cfg = drafter.cfg
    if args.format == "speculators":
        refusals = speculators_refusals(cfg)
        needs_target = cfg.own_embeddings or cfg.draft_vocab < cfg.vocab_size
    else:
        refusals = [r + (" (--widen-vocab writes it proposing from every token: a different drafter)"
                         if "reduced draft vocabulary" in r else "")
                    for r in deepspec_refusals(cfg, mask_token_id=args.mask_token_id)]
        needs_target = not cfg.own_embeddings
    if refusals:
        p.error(f"{args.drafter}: the {args.format} format cannot hold this drafter:"
                + "".join(f"\n  - {r}" for r in refusals))
    embed = lm_head = taps = n_layers = None
    if needs_target or cfg.tap_layers is None:
        from dspark_jax.build import load_target  # noqa: PLC0415

        target = load_target(args.model, dtype=jnp.float32)
        try:
            check_drafter_fits(cfg, target.cfg, source / "config.json")
        except ValueError as err:
            p.error(str(err))
        embed, lm_head, n_layers = target.weights.embed, target.weights.lm_head, target.cfg.n_layers
        taps = target.cfg.tap_layers if cfg.tap_layers is None else None
    dtype = None if args.store_dtype is None else jnp.dtype(args.store_dtype)
    attach = [source / name for name in CALIBRATION_FILES if (source / name).is_file()]
    try:
        if args.format == "speculators":
            save_speculators_drafter(drafter, out, embed=embed, lm_head=lm_head, verifier=args.verifier,
                                     verifier_architectures=_architectures(args.model), target_layer_ids=taps,
                                     dtype=dtype, attach=attach)
        else:
            save_deepspec_drafter(drafter, out, embed=embed, lm_head=lm_head, mask_token_id=args.mask_token_id,
                                  target_layer_ids=taps, num_target_layers=n_layers, dtype=dtype, attach=attach)
    except ValueError as err:
        p.error(str(err))
    print(f"wrote {out} ({args.format}; {', '.join(a.name for a in attach) or 'no calibration files'} copied)",
          file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
