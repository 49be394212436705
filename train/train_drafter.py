"""Train a DSpark (or DFlash baseline) drafter on the target cache. Resumable: run the same command again.

    python -m train.train_drafter --cache runs/data/cache --run runs/dspark --kind dspark --steps 2000
    python -m train.train_drafter --cache runs/data/cache --run runs/dflash --kind dflash --steps 2000

From an existing drafter (a shipped name, a folder written here, or an imported drafter that
`drafters.resolve_drafter` loads), training only part of it on the frozen rest:

    python -m train.train_drafter --cache runs/data/cache --run runs/heads --init-from dflash --train heads
    python -m train.train_drafter --cache runs/data/cache --run runs/conf --init-from runs/heads/export \
        --train confidence

``--train heads`` trains the sequential (Markov by default, or ``--head rnn``) and confidence heads, adding
those the source lacks, on its frozen backbone with the DSpark loss; ``--train confidence`` trains the
confidence head alone; ``--train all`` (the default) trains everything. The run folder records its
configuration (``run.json``); a resumed run must ask for the same drafter.

A drafter that travels (exports to vLLM speculators and DeepSpec, ``python -m dspark_jax.export``) has QK-norm in
its draft layers, no per-tap norms and its block slots embedded as a vocabulary row: ``--portable``, fresh or
fine-tuned from a drafter that lacks them (``--train all``; what was added, dropped and adapted is printed):

    python -m train.train_drafter --cache runs/data/cache --run runs/portable --kind dspark --portable \
        --init-from dspark --draft-vocab 0 --steps 1000 --lr 3e-4
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dspark_jax import data, heads, training
from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.sharding import mesh_from_args
from dspark_jax.drafters import SHIPPED, drafter_source, resolve_drafter
from dspark_jax.cli import nonnegative_float, nonnegative_int, positive_float, positive_int
from dspark_jax.models import drafter_files
from dspark_jax.models.deepspec import deepspec_refusals
from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.models.speculators import speculators_refusals
from dspark_jax.plots import plot_training
from dspark_jax.io import atomic_write_text

# Architecture options of a fresh drafter; a drafter trained --init-from takes them from its source (but for the
# draft vocabulary, which --draft-vocab may choose again, `heads.convert_drafter`).
FRESH_DEFAULTS = {"layers": 2, "ffn": 1536, "block": 7, "draft_vocab": 8192}
# What --portable sets: the form both export formats hold (`models.speculators.speculators_refusals`,
# `models.deepspec.deepspec_refusals`); the draft vocabulary stays the user's choice.
PORTABLE = {"qk_norm": True, "tap_norm": False, "mask_token": "auto"}


def check_cache_fits(cache: data.TargetCache, cache_dir: str, target_cfg) -> None:
    """The cache's tapped states must come from this target: (taps, width) = (len(tap_layers), dim)."""
    have = tuple(cache.taps.shape[1:])
    want = (len(target_cfg.tap_layers), target_cfg.dim)
    if have != want:
        raise ValueError(f"--cache {cache_dir}: its tapped states have (taps, width) = {have}, but the target "
                         f"has {want}; build the cache with the same --model (train.build_cache)")


# Held-out blocks are drawn with one fixed shape and seed, whatever the training batch's: runs with other
# --blocks, --context-tokens or --seed are then compared on the same blocks (8 batches of 8192 context tokens
# hold 2048 blocks from 64 to 256 sequences).
# Their buckets are fixed too, at the lengths every held-out figure so far was read on (sequences past 1024
# tokens are left out of them), where training batches use every sequence (`data.default_buckets`).
VAL_BLOCKS, VAL_CONTEXT_TOKENS, VAL_BUCKETS = 256, 8192, (256, 512, 1024)


def held_out_loader(val_cache, block: int) -> data.BlockLoader:
    return data.BlockLoader(val_cache, block=block, blocks=VAL_BLOCKS, context_tokens=VAL_CONTEXT_TOKENS,
                            buckets=VAL_BUCKETS, seed=0)


def init_source(args: argparse.Namespace, target) -> tuple[Drafter, Path]:
    """The --init-from drafter and its folder, loaded for ``target`` (an error names the option)."""
    try:
        drafter, _, _, source = resolve_drafter(args.init_from, target_cfg=target.cfg)
    except ValueError as err:
        raise ValueError(f"--init-from {args.init_from}: {err}") from err
    return drafter, source


def mask_token_arg(value: str) -> str | int:
    """``--mask-token``: a token id or ``auto``."""
    if value == "auto":
        return value
    try:
        token = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token id or 'auto', got {value!r}") from None
    if token < 0:
        raise argparse.ArgumentTypeError(f"expected a token id >= 0 or 'auto', got {value!r}")
    return token


def apply_portable(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Set what --portable implies (`PORTABLE`), refusing options that contradict it."""
    if not args.portable:
        return
    if args.qk_norm is False:
        p.error("--portable --no-qk-norm: both export formats' draft layers normalise queries and keys; drop "
                "--no-qk-norm")
    if args.tap_norm:
        p.error("--portable --tap-norm: neither export format holds per-tap norms (they project the raw tapped "
                "layers); drop --tap-norm")
    args.qk_norm, args.tap_norm = PORTABLE["qk_norm"], PORTABLE["tap_norm"]
    if args.mask_token is None:
        args.mask_token = PORTABLE["mask_token"]


def resolve_mask_token(args: argparse.Namespace, target, cache: data.TargetCache, source_mask: int | None
                       ) -> tuple[int | None, str | None]:
    """The mask token id --mask-token asks for and why (None, None without the option). ``auto`` keeps the
    --init-from drafter's own mask token when it has one, else `training.choose_mask_token` picks one the target
    never writes, among the tokens absent from the training cache."""
    if args.mask_token is None:
        return None, None
    vocab = target.cfg.vocab_size
    if args.mask_token != "auto":
        if not args.mask_token < vocab:
            raise ValueError(f"--mask-token {args.mask_token}: expected a token id below the target's {vocab}")
        return args.mask_token, "--mask-token"
    if source_mask is not None:
        return source_mask, "the --init-from drafter's own"
    try:
        return training.choose_mask_token(target.tokenizer, vocab, data.token_counts(cache, vocab))
    except ValueError as err:
        raise ValueError(f"--mask-token auto: {err}") from err


def validate_only(args: argparse.Namespace, target, val_cache: data.TargetCache) -> dict:
    """The --init-from drafter as it is (its own kind and heads), scored on the held-out blocks."""
    drafter, source = init_source(args, target)
    kind = "dspark" if drafter.cfg.confidence else "dflash"
    loss_cfg = dataclasses.replace(heads.loss_for("all", kind), kl=args.kl)
    val = training.validate_drafter(drafter, held_out_loader(val_cache, drafter.cfg.block), target.weights.embed,
                                    target.weights.lm_head, loss_cfg=loss_cfg,
                                    batches=training.TrainConfig.val_batches)
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run / "validation.json", json.dumps({"drafter": str(source), **val}, indent=1) + "\n")
    print(f"{source}: val_tau_prob {val['val_tau_prob']:.4f}, val_loss {val['val_loss']:.4f}")
    return val


OLD_BUCKETS = [256, 512, 1024]  # the fixed context buckets of every run recorded before run.json named them
# What a resumed run must share with its start besides the drafter: the step count (the learning-rate schedule
# spans it), the data-parallel size (it shapes each step's batch), the training data (sequences and tokens of
# the cache) and the draft vocabulary chosen from it (the checkpoints hold trained parameters only, so a
# vocabulary chosen again from another cache would map their rows to other tokens).
RECORDED_SINCE = ("steps", "data_parallel", "data", "draft_vocab")


def recorded_run(run: Path) -> dict | None:
    """The run.json of a run folder that holds checkpoints (a run to resume), else None."""
    path = run / "run.json"
    if not (run / "ckpt").is_dir() or not path.is_file():
        return None
    return json.loads(path.read_text())


def resumed_buckets(run: Path) -> list[int] | None:
    """The context buckets a run with checkpoints was started with (so that it resumes on the same batches
    whatever the cache's longest sequence now), or None for a new run (`data.default_buckets`)."""
    old = recorded_run(run)
    return None if old is None else old.get("buckets", OLD_BUCKETS)


def check_resume(run: Path, record: dict) -> None:
    """A run folder with checkpoints resumes only the drafter it was started for (same record)."""
    old = recorded_run(run)
    if old is None:
        return
    if isinstance(old.get("config"), dict):  # fields added to the config since have their defaults there
        old["config"] = DrafterConfig.from_dict(old["config"]).to_dict()
    fixed = {"buckets": OLD_BUCKETS}
    old, record = {**fixed, **old}, {**fixed, **record}
    unrecorded = [k for k in RECORDED_SINCE if k not in old]  # runs started before these were recorded
    diff = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k) and k not in unrecorded)
    if diff:
        raise ValueError(f"--run {run}: holds checkpoints of another configuration ({', '.join(diff)} differ: "
                         f"{ {k: old.get(k) for k in diff} } there, { {k: record.get(k) for k in diff} } now); "
                         f"use a new --run folder or the same options")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default="runs/data/cache")
    p.add_argument("--run", required=True, help="run folder (checkpoints, metrics, export)")
    p.add_argument("--kind", choices=["dspark", "dflash"], default="dspark")
    p.add_argument("--head", choices=["markov", "rnn"], default=None,
                   help="sequential head for dspark (default: markov, or the --init-from drafter's)")
    add_model_arguments(p, draft=False)
    p.add_argument("--init-from", metavar="DRAFTER", default=None,
                   help=f"start from this drafter ({' | '.join(SHIPPED)} | a drafter folder) instead of a fresh one")
    p.add_argument("--train", choices=heads.TRAIN_PARTS, default="all",
                   help="what to train: all parameters, the heads on a frozen backbone, or the confidence head "
                        "alone (heads and confidence need --init-from)")
    p.add_argument("--steps", type=positive_int, default=2000)
    p.add_argument("--layers", type=positive_int, default=None, help=f"default {FRESH_DEFAULTS['layers']}")
    p.add_argument("--ffn", type=positive_int, default=None, help=f"default {FRESH_DEFAULTS['ffn']}")
    p.add_argument("--rank", type=positive_int, default=None, help="Markov / RNN head rank (default: the spec's 256, or "
                                                          "the --init-from drafter's)")
    p.add_argument("--block", type=positive_int, default=None, help=f"default {FRESH_DEFAULTS['block']}")
    p.add_argument("--tap-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="RMS-normalise each tapped target layer before the context projection (default: off, or "
                        "the --init-from drafter's; both export formats need it off)")
    p.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="RMS-normalise each head's queries and keys in the draft layers, as Qwen3 layers do "
                        "(default: off, or the --init-from drafter's; both export formats need it)")
    p.add_argument("--mask-token", type=mask_token_arg, default=None, metavar="ID|auto",
                   help="embed the block slots as the target's embedding row ID instead of a learned vector (both "
                        "export formats need it); auto: the --init-from drafter's, else a token the target never "
                        "writes (its mask token, an embedding row past its tokenizer, or an unused special token: "
                        "SmolLM2's <empty_output>, 16; dspark_jax.training.choose_mask_token)")
    p.add_argument("--portable", action="store_true",
                   help="a drafter both export formats hold (python -m dspark_jax.export): --qk-norm --no-tap-norm "
                        "--mask-token auto; with --init-from, the source is converted and fine-tuned (--train all). "
                        "The draft vocabulary stays yours: speculators holds a reduced one, DeepSpec only the "
                        "full vocabulary (--draft-vocab 0)")
    p.add_argument("--init-layers", type=int, nargs="+", default=None, metavar="I",
                   help="a fresh drafter's decoder layers (and final norm) start from these target layers, one per "
                        "drafter layer (negative: from the last; e.g. -2 -1); --ffn then defaults to the target's")
    p.add_argument("--no-init-context", action="store_true",
                   help="with --init-layers: keep the context projection fresh (by default it starts as the "
                        "deepest tapped layer, normalised as the first copied layer normalises its input)")
    p.add_argument("--draft-vocab", type=nonnegative_int, default=None,
                   help=f"0 = full target vocabulary (default {FRESH_DEFAULTS['draft_vocab']}, or the --init-from "
                        f"drafter's; given with --init-from, chosen again and the heads' rows mapped onto it). The "
                        f"speculators format holds a reduced vocabulary, DeepSpec's only the full one (0)")
    p.add_argument("--kl", type=nonnegative_float, default=0.0, metavar="WEIGHT",
                   help="weight of the distillation term (soft cross-entropy against the target's distribution "
                        "over the draft vocabulary; see dspark_jax.training); default 0: the spec's loss")
    p.add_argument("--val-cache", default=None, metavar="DIR",
                   help="a target cache of held-out sequences (train.build_cache of other shards): its validation "
                        "loss and probabilistic accepted length go to metrics.jsonl every --val-every steps")
    p.add_argument("--val-every", type=positive_int, default=100)
    p.add_argument("--validate-only", action="store_true",
                   help="train nothing: the --init-from drafter's held-out metrics on --val-cache go to "
                        "RUN/validation.json (the blocks training runs are validated on)")
    p.add_argument("--blocks", type=positive_int, default=256, help="blocks per batch")
    p.add_argument("--context-tokens", type=positive_int, default=8192,
                   help="context tokens per batch: with --blocks, how many sequences a step draws its blocks from "
                        "(8192: 8 to 32 sequences; 2048 learned less per step, docs/design.md)")
    p.add_argument("--lr", type=positive_float, default=6e-4)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    args = p.parse_args(argv)

    # Every check that needs no model comes first.
    apply_portable(args, p)
    switches = [f"--{k.replace('_', '-')}" for k in ("qk_norm", "tap_norm", "mask_token", "draft_vocab")
                if getattr(args, k) is not None]
    if args.validate_only and (switches or args.portable):
        p.error(f"{', '.join(['--portable'] if args.portable else switches)}: --validate-only scores the --init-from "
                f"drafter as it is; drop them")
    if args.init_from is None:
        if args.train != "all":
            p.error(f"--train {args.train} trains part of an existing drafter: name it with --init-from DRAFTER")
    else:
        given = [f"--{k.replace('_', '-')}" for k in FRESH_DEFAULTS
                 if k != "draft_vocab" and getattr(args, k) is not None]
        given += ["--init-layers"] if args.init_layers is not None else []
        if given:
            p.error(f"{', '.join(given)}: the architecture comes from --init-from {args.init_from}; drop them")
        if switches and args.train != "all":
            p.error(f"{', '.join(['--portable'] if args.portable else switches)}: converting the --init-from "
                    f"drafter changes its backbone or vocabulary, which --train {args.train} keeps frozen; use "
                    f"--train all")
        try:
            drafter_source(args.init_from)
        except ValueError as e:
            p.error(str(e).replace("--draft", "--init-from", 1))
    n_layers = FRESH_DEFAULTS["layers"] if args.layers is None else args.layers
    if args.init_layers is not None and len(args.init_layers) != n_layers:
        p.error(f"--init-layers {' '.join(map(str, args.init_layers))}: expected one target layer per drafter "
                f"layer ({n_layers})")
    if args.no_init_context and args.init_layers is None:
        p.error("--no-init-context: only with --init-layers")
    if args.validate_only and (args.init_from is None or args.val_cache is None):
        p.error("--validate-only: name the drafter with --init-from and the held-out cache with --val-cache")
    if args.kind == "dflash" and args.head is not None:
        p.error("--head: a DFlash drafter has no sequential head")
    if args.kl and args.train == "confidence":
        p.error("--kl: --train confidence trains the confidence head alone, which the distillation term does not reach")
    try:
        cache = None if args.validate_only else data.open_target_cache(args.cache)  # validation reads no training data
        val_cache = None if args.val_cache is None else data.open_target_cache(args.val_cache)
    except (ValueError, OSError) as e:
        p.error(str(e))
    run = Path(args.run)

    mesh = mesh_from_args(args)  # data-parallel training over --data-parallel-size devices
    target = load_target(args.model, dtype=args.dtype)
    if cache is not None:
        check_cache_fits(cache, args.cache, target.cfg)
    if val_cache is not None:
        check_cache_fits(val_cache, args.val_cache, target.cfg)
    if args.validate_only:
        return validate_only(args, target, val_cache)
    # the draft vocabulary covers the target's probability mass: token counts of its T = 1 answers estimate it
    freqs = data.token_frequencies(cache, target.cfg.vocab_size, temperature=1.0)
    dspark = args.kind == "dspark"
    fresh: list[str] = []
    dropped: list[str] = []
    adapted: list[str] = []
    stops = tuple(target.tokenizer.stop_ids)
    if args.init_from is None:
        arch = {k: FRESH_DEFAULTS[k] if getattr(args, k) is None else getattr(args, k) for k in FRESH_DEFAULTS}
        if args.init_layers is not None and args.ffn is None:
            arch["ffn"] = target.cfg.ffn_dim  # layers started from the target's have its FFN width
        vocab = training.choose_draft_vocab(freqs, arch["draft_vocab"], always=stops)
        mask, mask_why = resolve_mask_token(args, target, cache, None)
        cfg = DrafterConfig.for_target(
            target.cfg, n_layers=arch["layers"], ffn_dim=arch["ffn"], block=arch["block"],
            rank=256 if args.rank is None else args.rank, head=(args.head or "markov") if dspark else "none",
            confidence=dspark, draft_vocab_size=0 if len(vocab) == target.cfg.vocab_size else len(vocab),
            tap_norm=bool(args.tap_norm), qk_norm=bool(args.qk_norm), mask_token=mask,
        )
        drafter = Drafter(cfg, rngs=nnx.Rngs(args.seed), vocab_ids=vocab)
        if args.init_layers is not None:
            try:
                training.init_layers_from_target(drafter, target.weights, args.init_layers,
                                                 context_tap=None if args.no_init_context else -1)
            except ValueError as err:
                raise ValueError(f"--init-layers {' '.join(map(str, args.init_layers))}: {err}") from err
        source = None
    else:
        src, source = init_source(args, target)
        cfg = heads.head_config(src.cfg, part=args.train, kind=args.kind, head=args.head, rank=args.rank)
        mask, mask_why = resolve_mask_token(args, target, cache, src.cfg.mask_token)
        switched = {k: v for k, v in (("qk_norm", args.qk_norm), ("tap_norm", args.tap_norm), ("mask_token", mask))
                    if v is not None}
        vocab = None
        if args.draft_vocab is not None:
            vocab = training.choose_draft_vocab(freqs, args.draft_vocab, always=stops)
            switched["draft_vocab_size"] = 0 if len(vocab) == target.cfg.vocab_size else len(vocab)
        cfg = dataclasses.replace(cfg, **switched)
        tap_rms = data.tap_rms(cache) if cfg.tap_norm != src.cfg.tap_norm else None
        qk_scales = None
        if cfg.qk_norm and not src.cfg.qk_norm:  # fitted on one small batch of the training cache
            fit_loader = data.BlockLoader(cache, block=src.cfg.block, blocks=64, context_tokens=2048, seed=args.seed)
            qk_scales = heads.fit_qk_norm_scales(src, fit_loader.batch(0), target.weights.embed)
        try:
            conv = heads.convert_drafter(src, cfg, seed=args.seed, vocab_ids=vocab, tap_rms=tap_rms,
                                         qk_scales=qk_scales)
        except ValueError as err:
            raise ValueError(f"--init-from {args.init_from}: {err}") from err
        drafter, fresh, dropped, adapted = conv.drafter, conv.fresh, conv.dropped, conv.adapted
        vocab = jax.device_get(drafter.vocab_ids[...])
    covered = freqs[vocab].sum() / max(freqs.sum(), 1)
    record = {"kind": args.kind, "train": args.train, "init_from": None if source is None else str(source),
              "config": cfg.to_dict(), "model": args.model, "seed": args.seed,
              **({"kl": args.kl} if args.kl else {}),  # absent at 0: runs started before the option resume
              **({"init_layers": args.init_layers, "init_context": not args.no_init_context}
                 if args.init_layers is not None else {}),
              "lr": args.lr, "blocks": args.blocks, "context_tokens": args.context_tokens}
    loader = data.BlockLoader(cache, block=cfg.block, blocks=args.blocks, context_tokens=args.context_tokens,
                              seed=args.seed, buckets=resumed_buckets(run),
                              sequences_multiple=1 if mesh is None else mesh.shape["data"])
    record["buckets"] = list(loader.buckets)
    record.update(steps=args.steps, data_parallel=1 if mesh is None else int(mesh.shape["data"]),
                  data={"sequences": int(loader.num_sequences), "tokens": int(loader.num_tokens)},
                  draft_vocab=hashlib.sha256(np.asarray(vocab, np.int64).tobytes()).hexdigest()[:16])
    check_resume(run, record)
    run.mkdir(parents=True, exist_ok=True)
    writer = jax.process_index() == 0  # one process of a multi-process run writes the run's files
    if writer:
        atomic_write_text(run / "run.json", json.dumps(record, indent=1) + "\n")

    trainable = heads.trainable_filter(args.train, cfg)
    n_params, n_train = heads.count_params(drafter), heads.count_params(drafter, trainable)
    print(f"{args.kind}: {n_train / 1e6:.2f}M of {n_params / 1e6:.2f}M parameters trained (--train {args.train}"
          + (f", from {source}" if source is not None else "")
          + f"), draft vocabulary {len(vocab)} ({covered:.2%} of sampled assistant tokens), {loader.num_tokens} tokens "
          f"in {loader.num_sequences} of {cache.num_sequences} sequences, context buckets "
          f"{loader.buckets}")
    if source is not None:
        print(f"from {source}: initialised fresh: {', '.join(fresh) or 'none'}; dropped: {', '.join(dropped) or 'none'}"
              + "".join(f"\n  adapted {a}" for a in adapted))
    print(f"draft layers: qk_norm={cfg.qk_norm}, tap_norm={cfg.tap_norm}, mask_token={cfg.mask_token}"
          + (f" ({mask_why})" if mask_why and cfg.mask_token is not None else ""))
    if args.portable:
        refused = {fmt: r for fmt, r in (("speculators", speculators_refusals(cfg)),
                                          ("deepspec", deepspec_refusals(cfg))) if r}
        print("portable: exports to " + ", ".join(f for f in ("speculators", "deepspec") if f not in refused)
              + "".join(f"; not {fmt}: {'; '.join(r)}" for fmt, r in refused.items()))
    tc = training.TrainConfig(steps=args.steps, lr=args.lr, seed=args.seed, val_every=args.val_every)
    val_loader = None if val_cache is None else held_out_loader(val_cache, cfg.block)
    t0 = time.perf_counter()
    drafter = training.train(drafter, loader, target.weights.embed, target.weights.lm_head, tc=tc,
                             loss_cfg=dataclasses.replace(heads.loss_for(args.train, args.kind), kl=args.kl),
                             run_dir=run, trainable=trainable, mesh=mesh, val_loader=val_loader)
    wall = time.perf_counter() - t0
    if not writer:
        return
    plot_training(run / "metrics.jsonl", run / "training.png", title=f"{args.kind} ({args.steps} steps)")
    last = training.metric_rows(run / "metrics.jsonl")[-1]
    info = {"kind": args.kind, "steps": args.steps, "params": n_params, "trained_params": n_train,
            "train": args.train, "init_from": record["init_from"], "new_params": fresh,
            **({"dropped_params": dropped, "adapted_params": adapted} if dropped or adapted else {}),
            **({"mask_token_choice": mask_why} if mask_why else {}),
            "draft_vocab_coverage": float(covered), "train_tokens": loader.num_tokens,
            "final_tau_prob": last["tau_prob"], "final_val_tau_prob": last.get("val_tau_prob"),
            "wall_seconds_this_run": wall, "args": vars(args)}
    drafter_files.save_drafter(drafter, run / "export", extra={"training": info})
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
