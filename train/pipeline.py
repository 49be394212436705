"""The drafter pipeline in one resumable command: the target's answers, its hidden-state cache, a DSpark drafter
and its DFlash baseline (same data, steps, seed and recipe options), STS calibration of DSpark's confidence
head, and the evaluation of both on the held-out half of the dev prompts at temperatures 0 and 1.

    python -m train.pipeline --out runs/pipeline                          # SmolLM2: every shard, 2000 steps
    python -m train.pipeline --out runs/short --shards 8 --steps 300      # a shorter run on the first 8 shards
    python -m train.pipeline --out runs/pipeline --kl 1.0 --tap-norm --layers 3   # recipe options, both drafters
    python -m train.pipeline --out runs/portable --shards 64 --steps 1000 --lr 3e-4 --seed 1 \
        --portable --init-from shipped --draft-vocab 0    # the shipped pair fine-tuned into drafters that travel

Stages, in order (each runs the command named, in a process of its own, whose progress it prints):

    data              train.generate_data    answers in --data (shared by every --out; committed shards count)
    cache             train.build_cache      OUT/cache: the shards but the last --val-shards; OUT/val_cache: those
    train-dspark      train.train_drafter    OUT/dspark (held-out tau in its metrics.jsonl); train-dflash the same,
                                             --kind dflash: OUT/dflash
    calibrate-dspark  train.calibrate        STS beside OUT/dspark/export, from the dev calibration half
    calibrate-dflash  train.calibrate        (DFlash has no confidence head: skipped)
    eval              train.evaluate         OUT/eval/t{0,1}/{dspark,dflash}_{domain}.json, held-out dev half
    summary           train.summarize_eval   OUT/eval/t{0,1}/summary.json and the tables on stdout
    export            dspark_jax.export      with --portable: OUT/export/{dspark,dflash}-speculators, and
                                             -deepspec for a drafter of the full vocabulary (DeepSpec's only)

``--init-from shipped`` starts each drafter from the shipped one of its kind, ``--init-from DIR`` from
``DIR/dspark/export`` and ``DIR/dflash/export`` (an earlier pipeline's); the architecture is then theirs, and
``--portable`` converts them (``train.train_drafter --init-from``).

Everything resumes where it stopped: generated shards and cache shards are kept, training restarts from its last
Orbax checkpoint, an evaluation whose report exists is not run again. ``OUT/pipeline.json`` records the
settings and, per stage, its wall time and whether it finished; a finished stage is skipped, and a run with
other settings into the same --out is refused. At the end the stage times and their total are printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from dspark_jax.io import atomic_write_text

DOMAINS = ("gsm8k", "mbpp", "livecodebench", "arena-hard", "mt-bench")
DRAFTERS = ("dspark", "dflash")
TEMPERATURES = (0.0, 1.0)
RECORD = "pipeline.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the run's folder (cache, drafters, reports, pipeline.json)")
    p.add_argument("--data", default="data/responses", help="generated answers (train.generate_data --out)")
    p.add_argument("--train-prompts", default="../shared/data/prompts/train")
    p.add_argument("--dev-prompts", default="../shared/data/prompts/dev")
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--shards", type=int, default=None,
                   help="use the first N shards of answers (generating what is missing); default every prompt")
    p.add_argument("--val-shards", type=int, default=1,
                   help="the last N shards are held out: their teacher-forced accepted length is logged in training")
    p.add_argument("--steps", type=int, default=2000, help="training steps of each drafter")
    p.add_argument("--layers", type=int, default=None, help="draft layers (train.train_drafter's default)")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary (train_drafter's default)")
    p.add_argument("--tap-norm", action="store_true", help="normalise each tapped layer (train_drafter)")
    p.add_argument("--qk-norm", action="store_true", help="QK-norm in the draft layers (train_drafter --qk-norm)")
    p.add_argument("--mask-token", default=None, metavar="ID|auto",
                   help="the block slots as the target's embedding row ID (train_drafter --mask-token)")
    p.add_argument("--portable", action="store_true",
                   help="drafters both export formats hold (train_drafter --portable: --qk-norm, no per-tap norms, "
                        "--mask-token auto), and an export stage; speculators holds a reduced draft vocabulary, "
                        "DeepSpec only the full one (--draft-vocab 0)")
    p.add_argument("--init-from", default=None, metavar="shipped|DIR",
                   help="start each drafter from the shipped one of its kind, or from DIR/{dspark,dflash}/export "
                        "(train_drafter --init-from)")
    p.add_argument("--kl", type=float, default=0.0, help="distillation weight (train_drafter --kl)")
    p.add_argument("--init-layers", type=int, nargs="+", default=None, metavar="I",
                   help="both drafters' layers start from these target layers (train_drafter --init-layers)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (train_drafter's default)")
    p.add_argument("--context-tokens", type=int, default=None,
                   help="context tokens per training batch (train_drafter's default)")
    p.add_argument("--eval-limit", type=int, default=20, help="held-out dev prompts per domain and temperature")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p


def settings_of(args: argparse.Namespace) -> dict:
    """The options that decide the results (a resumed run must repeat them). Options added later are recorded
    only when given, so that runs started before them resume."""
    settings = {k: getattr(args, k) for k in ("data", "model", "shards", "val_shards", "steps", "layers", "draft_vocab",
                                              "tap_norm", "kl", "lr", "context_tokens", "eval_limit",
                                              "eval_max_new_tokens", "seed")}
    if args.init_layers is not None:
        settings["init_layers"] = list(args.init_layers)
    for key in ("qk_norm", "portable"):
        if getattr(args, key):
            settings[key] = True
    for key in ("mask_token", "init_from"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings


Command = tuple[str, Callable[[list[str]], object], list[str], Path | None]  # label, main, argv, output (skip if present)


COMMANDS = ("generate_data", "build_cache", "train_drafter", "calibrate", "evaluate", "summarize_eval", "export")
MODULES = {"export": "dspark_jax.export"}  # the commands outside train/
FORMATS = ("speculators", "deepspec")


# ``python -m MODULE ARGV`` with Ctrl-C's default handler restored: a process started in the background by a
# shell without job control (``nohup ... &``, a CI job) ignores SIGINT, and its children would inherit that and
# never unwind when the pipeline hands them SIGINT.
_CHILD = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "module = sys.argv.pop(1); runpy.run_module(module, run_name='__main__', alter_sys=True)")


def command_in_process(module: str, grace_seconds: float = 120.0) -> Callable[[Sequence[str]], None]:
    """A main that runs ``python -m module ARGV`` in a child process and waits for it. Each command compiles
    its own programs; in one long-lived process their machine code accumulates until the compiler cannot map
    more (twelve evaluations in a row ended with LLVM's "Cannot allocate memory"), and a child returns all of
    it. When the wait is interrupted (Ctrl-C, or SIGTERM through `exit_on_sigterm`) the child gets SIGINT, so
    it unwinds as an interrupted command does (training saves its checkpoint), and is killed after
    ``grace_seconds``. The child has a process group of its own, so a Ctrl-C at the terminal reaches it once,
    through the pipeline, and not a second time in the middle of that unwinding.

    Raises:
      SystemExit: naming the command when it exits with a non-zero status.
    """
    def main(argv: Sequence[str]) -> None:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, module, *argv], process_group=0)
        try:
            status = proc.wait()
        except BaseException:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=grace_seconds)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            raise
        if status != 0:
            raise SystemExit(f"{module} {' '.join(argv)}: exited with status {status}")

    return main


def _mains():
    """The stages' entry points: each command in a child process (`command_in_process`)."""
    return {name: command_in_process(MODULES.get(name, f"train.{name}")) for name in COMMANDS}


def count_shards(folder: Path) -> int:
    return len(list(folder.glob("shard_*.npz")))


def total_shards(args: argparse.Namespace) -> int:
    """The shards the run uses: --shards, else every shard of the prompt set (the data stage's manifest)."""
    if args.shards is not None:
        return args.shards
    manifest = json.loads((Path(args.data) / "manifest.json").read_text())["settings"]
    return -(-manifest["prompts"] // manifest["shard_prompts"])


def plan(args: argparse.Namespace, mains: dict) -> list[tuple[str, list[Command]]]:
    """The stages and their commands."""
    out, data = Path(args.out), Path(args.data)
    model = ["--model", args.model] if args.model else []
    stages: list[tuple[str, list[Command]]] = []
    gen = ["--out", str(data), "--prompts", args.train_prompts, "--no-progress"] + model
    if args.shards is not None:
        missing = max(0, args.shards - count_shards(data))
        gen += ["--max-shards", str(missing)]
    stages.append(("data", [] if args.shards is not None and missing == 0
                   else [("generate_data", mains["generate_data"], gen, None)]))
    caches = []  # the shard counts are read when the stage runs: the data stage writes the manifest first
    for name, part in (("cache", "train"), ("val_cache", "val")):
        if part == "val" and not args.val_shards:
            continue
        argv = ["--data", str(data), "--out", str(out / name)] + model
        caches.append((f"build_cache {part}", _with_shards(mains["build_cache"], args, part), argv, None))
    stages.append(("cache", caches))
    recipe = []
    for flag, value in (("--layers", args.layers), ("--draft-vocab", args.draft_vocab), ("--lr", args.lr),
                        ("--context-tokens", args.context_tokens)):
        recipe += [] if value is None else [flag, str(value)]
    recipe += ["--tap-norm"] if args.tap_norm else []
    recipe += ["--qk-norm"] if args.qk_norm else []
    recipe += ["--mask-token", args.mask_token] if args.mask_token is not None else []
    recipe += ["--portable"] if args.portable else []
    recipe += ["--kl", str(args.kl)] if args.kl else []
    recipe += ["--init-layers", *map(str, args.init_layers)] if args.init_layers is not None else []
    for kind in DRAFTERS:
        argv = ["--cache", str(out / "cache"), "--run", str(out / kind), "--kind", kind, "--steps", str(args.steps),
                "--seed", str(args.seed)] + recipe + model
        argv += [] if args.init_from is None else ["--init-from", init_source(args.init_from, kind)]
        argv += ["--val-cache", str(out / "val_cache")] if args.val_shards else []
        stages.append((f"train-{kind}", [("train_drafter", mains["train_drafter"], argv, None)]))
    for kind in DRAFTERS:
        cmds = [] if kind == "dflash" else [
            ("calibrate", mains["calibrate"], ["--draft", str(out / kind / "export"), "--prompts", args.dev_prompts]
             + model, None)]
        stages.append((f"calibrate-{kind}", cmds))
    evals: list[Command] = []
    for t in TEMPERATURES:
        for kind in DRAFTERS:
            for dom in DOMAINS:
                report = out / "eval" / f"t{t:g}" / f"{kind}_{dom}.json"
                argv = ["--draft", str(out / kind / "export"), "--prompts", str(Path(args.dev_prompts) / f"{dom}.jsonl"),
                        "--half", "eval", "--limit", str(args.eval_limit), "--temperature", f"{t:g}",
                        "--max-new-tokens", str(args.eval_max_new_tokens), "--seed", str(args.seed),
                        "--json", str(report)] + model
                evals.append((f"evaluate {kind} {dom} T={t:g}", mains["evaluate"], argv, report))
    stages.append(("eval", evals))
    summaries: list[Command] = []
    for t in TEMPERATURES:
        folder = out / "eval" / f"t{t:g}"
        summaries.append((f"summary T={t:g}", mains["summarize_eval"],
                          ["--dir", str(folder), "--drafts", "dflash", "dspark", "--domains", *DOMAINS,
                           "--json", str(folder / "summary.json")], None))
    stages.append(("summary", summaries))
    if args.portable:
        exports: list[Command] = []
        for kind in DRAFTERS:
            for fmt in FORMATS:
                folder = out / "export" / f"{kind}-{fmt}"
                argv = ["--format", fmt, str(out / kind / "export"), str(folder)] + model
                exports.append((f"export {kind} {fmt}", _exported(mains["export"], fmt), argv, None))
        stages.append(("export", exports))
    return stages


def init_source(spec: str, kind: str) -> str:
    """The --init-from drafter of ``kind`` for the pipeline's --init-from: the shipped one of its name, or the
    export of an earlier pipeline folder's."""
    return kind if spec == "shipped" else str(Path(spec) / kind / "export")


def _exported(export_main, fmt: str):
    """dspark_jax.export's main for one format, skipping an output already written (it writes atomically) and, for
    DeepSpec, a drafter of a reduced draft vocabulary (which that format cannot hold), saying so."""
    def main(argv):
        drafter, out = Path(argv[2]), Path(argv[3])
        if (out / "config.json").is_file():
            print(f"   {out} exists")
            return None
        cfg = json.loads((drafter / "config.json").read_text())["config"]
        if fmt == "deepspec" and cfg.get("draft_vocab_size", 0):
            print(f"   {drafter}: not written as DeepSpec, which holds the full vocabulary only (this drafter "
                  f"proposes {cfg['draft_vocab_size']} of {cfg['vocab_size']} tokens; --draft-vocab 0 for both, or "
                  f"dspark_jax.export --widen-vocab for a widened, different drafter)")
            return None
        return export_main(argv)

    return main


def _with_shards(build_cache_main, args: argparse.Namespace, part: str):
    """build_cache's main, given the shard range of ``part`` ("train" or "val") once the shard count is known."""
    def main(argv):
        n = total_shards(args)
        if args.val_shards >= n:
            raise SystemExit(f"--val-shards {args.val_shards}: leaves no training shard of {n}")
        lo, hi = (0, n - args.val_shards) if part == "train" else (n - args.val_shards, n)
        return build_cache_main(list(argv) + ["--shards", f"{lo}:{hi}"])

    return main


def check_inputs(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Refuse bad options and missing prompt sets before any long work."""
    for name in ("steps", "eval_limit", "eval_max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    if args.shards is not None and args.shards < 1:
        p.error(f"--shards {args.shards}: expected an integer >= 1")
    if args.val_shards < 0 or (args.shards is not None and args.val_shards >= args.shards):
        p.error(f"--val-shards {args.val_shards}: expected 0 <= N < --shards ({args.shards})")
    if args.lr is not None and not args.lr > 0:
        p.error(f"--lr {args.lr}: expected a learning rate > 0")
    if args.context_tokens is not None and args.context_tokens < 1:
        p.error(f"--context-tokens {args.context_tokens}: expected an integer >= 1")
    if not args.kl >= 0:
        p.error(f"--kl {args.kl}: expected a weight >= 0")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers {args.layers}: expected an integer >= 1")
    if args.draft_vocab is not None and args.draft_vocab < 0:
        p.error(f"--draft-vocab {args.draft_vocab}: expected an integer >= 0 (0: the whole vocabulary)")
    if args.model is not None and not Path(args.model).exists():
        p.error(f"--model {args.model}: no such file or folder (a GGUF file or a Hugging Face checkpoint folder)")
    if args.portable and args.tap_norm:
        p.error("--portable --tap-norm: neither export format holds per-tap norms; drop --tap-norm")
    if args.mask_token is not None and args.mask_token != "auto" and not args.mask_token.isdigit():
        p.error(f"--mask-token {args.mask_token}: expected a token id or 'auto'")
    if args.init_from is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("layers", "init_layers") if getattr(args, k) is not None]
        if given:
            p.error(f"{', '.join(given)}: the architecture comes from --init-from {args.init_from}; drop them")
        if args.init_from != "shipped":
            missing = [k for k in DRAFTERS if not (Path(init_source(args.init_from, k)) / "config.json").is_file()]
            if missing:
                p.error(f"--init-from {args.init_from}: expected 'shipped' or an earlier pipeline's --out folder "
                        f"(no {', '.join(init_source(args.init_from, k) for k in missing)})")
    if args.init_layers is not None:
        from train.train_drafter import FRESH_DEFAULTS  # noqa: PLC0415 (loads JAX: only when the option is given)

        n_layers = FRESH_DEFAULTS["layers"] if args.layers is None else args.layers
        if len(args.init_layers) != n_layers:  # train_drafter's own check, made before the data stage's hours
            p.error(f"--init-layers {' '.join(map(str, args.init_layers))}: expected one target layer per drafter "
                    f"layer ({n_layers})")
    dev = Path(args.dev_prompts)
    missing = [d for d in DOMAINS if not (dev / f"{d}.jsonl").is_file()]
    if missing:
        p.error(f"--dev-prompts {dev}: missing {', '.join(f'{d}.jsonl' for d in missing)} (the evaluation's "
                f"held-out prompts)")
    if not Path(args.train_prompts).exists():
        p.error(f"--train-prompts {args.train_prompts}: no such file or folder")


def load_record(path: Path, settings: dict) -> dict:
    if not path.is_file():
        return {"settings": settings, "stages": {}}
    record = json.loads(path.read_text())
    old = record.get("settings", {})
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if diff:
        raise SystemExit(f"{path}: this folder was started with other settings ({', '.join(diff)}: "
                         f"{ {k: old.get(k) for k in diff} } there, { {k: settings.get(k) for k in diff} } now); "
                         f"use a new --out or the same options")
    return record


def run(args: argparse.Namespace, mains: dict | None = None, log: Callable[[str], None] = print) -> dict:
    """Run the stages not yet finished; returns the record (settings, per-stage seconds and state)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORD
    record = load_record(path, settings_of(args))
    save = lambda: atomic_write_text(path, json.dumps(record, indent=1) + "\n")  # noqa: E731
    for name, commands in plan(args, mains or _mains()):
        entry = record["stages"].setdefault(name, {"seconds": 0.0, "finished": False})
        if entry["finished"]:
            log(f"== {name}: finished earlier ({entry['seconds'] / 60:.1f} min)")
            continue
        log(f"== {name} ({datetime.datetime.now(datetime.timezone.utc).strftime('%H:%M:%S')} UTC)")
        t0 = time.perf_counter()
        try:
            for label, main, argv, output in commands:
                if output is not None and output.is_file():
                    log(f"   {label}: {output} exists")
                    continue
                if output is not None:
                    output.parent.mkdir(parents=True, exist_ok=True)
                log(f"   {label}: {' '.join(argv)}")
                main(argv)
        finally:
            entry["seconds"] += time.perf_counter() - t0  # time spent, also by an interrupted attempt
            save()
        entry["finished"] = True
        save()
    total = sum(e["seconds"] for e in record["stages"].values())
    log("stage              minutes")
    for name, e in record["stages"].items():
        log(f"{name:<18} {e['seconds'] / 60:8.1f}")
    log(f"{'total':<18} {total / 60:8.1f}")
    record["total_seconds"] = total
    save()
    return record


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, a scheduler's stop) unwind like Ctrl-C: the stage in progress records its seconds
    and the next run resumes it. Without this the process dies at once and the stage's time is lost. SIGINT
    is restored too: a shell starts a background job with it ignored, and ``kill -INT`` should stop it."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    check_inputs(args, p)
    exit_on_sigterm()
    return run(args)


if __name__ == "__main__":
    main()
