"""Compare training runs on their held-out metrics: the ablation table (markdown, optionally JSON).

    python -m train.compare_runs runs/abl-base runs/abl-tapnorm runs/abl-kl --json runs/ablation.json

Reads each RUN's run.json (the drafter's configuration and recipe) and metrics.jsonl (what
`train.train_drafter --val-cache` logs). Every run is read at the same step, the largest step at which all of
them logged held-out metrics (with ``--step N``, at step N). Runs of one ``--steps`` compare like with like: the
learning-rate schedule follows ``--steps``, so a longer run at the same step is earlier in its schedule.
Columns: the recipe (what differs between the runs), the step, the held-out loss and probabilistic accepted
length (tau at G drafts, teacher-forced), the training tau at that step, seconds per step (the
median of the logged rows: the cost of the recipe on the machine it ran on) and parameters (once a run
has finished and exported).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# recipe fields of run.json's "config" (and the run's own "kl") shown when they differ between the runs
RECIPE = ("n_layers", "ffn_dim", "rank", "head", "draft_vocab_size", "tap_norm", "block")
OPTIM = ("lr", "blocks", "context_tokens")  # train.train_drafter's options that shape the optimisation


def read_run(folder: Path) -> dict:
    """run.json and the logged rows of one run; a clear error when it is not a training run's folder."""
    run_json, metrics = folder / "run.json", folder / "metrics.jsonl"
    for path in (run_json, metrics):
        if not path.is_file():
            raise SystemExit(f"{folder}: no {path.name}; expected a train.train_drafter --run folder")
    rows = []
    for n, line in enumerate(metrics.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{metrics}:{n}: not a JSON line ({e}); expected train.train_drafter's metrics") from None
    try:
        run = json.loads(run_json.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"{run_json}: not valid JSON ({e})") from None
    export = folder / "export" / "config.json"  # written when the run finished: its parameter count
    training = json.loads(export.read_text())["training"] if export.is_file() else {}
    return {"name": folder.name, "run": run, "rows": rows,
            "params": training.get("params"), "args": training.get("args", {})}


def recipe_of(run: dict) -> dict:
    cfg = run["run"]["config"]
    recipe = {"kind": run["run"]["kind"], **{k: cfg.get(k) for k in RECIPE}}
    recipe["kl"] = run["run"].get("kl", 0.0)
    for key in OPTIM:  # run.json holds them; runs started before it did, their export's arguments
        recipe[key] = run["run"].get(key, run["args"].get(key))
    return recipe


def common_val_step(runs: list[dict]) -> int:
    """The largest step at which every run logged held-out metrics."""
    steps = [{r["step"] for r in run["rows"] if "val_tau_prob" in r} for run in runs]
    for run, s in zip(runs, steps, strict=True):
        if not s:
            raise SystemExit(f"{run['name']}: no held-out metrics in metrics.jsonl (train with --val-cache)")
    shared = set.intersection(*steps)
    if not shared:
        raise SystemExit("the runs share no step with held-out metrics; name one with --step")
    return max(shared)


def row_at(run: dict, step: int) -> dict:
    for r in run["rows"]:
        if r["step"] == step and "val_tau_prob" in r:
            return r
    raise SystemExit(f"{run['name']}: no held-out metrics logged at step {step}")


def compare(runs: list[dict], step: int | None = None) -> dict:
    """Per run: its recipe, and at the shared step its held-out and training metrics and its cost."""
    step = common_val_step(runs) if step is None else step
    out = {"step": step, "runs": []}
    for run in runs:
        r = row_at(run, step)
        per_step = [x["seconds_per_step"] for x in run["rows"] if x["step"] <= step]
        out["runs"].append({
            "name": run["name"], "recipe": recipe_of(run), "val_loss": r["val_loss"],
            "val_tau_prob": r["val_tau_prob"], "tau_prob": r["tau_prob"],
            "seconds_per_step": float(np.median(per_step)),
            "params": run["params"],
        })
    return out


def table(result: dict) -> str:
    runs = result["runs"]
    keys = [k for k in runs[0]["recipe"] if len({json.dumps(r["recipe"][k]) for r in runs}) > 1]
    head = ["run", *keys, "step", "val loss", "val tau", "train tau", "params (M)", "s / step"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * (1 + len(keys)) + " ---: |" * 6]
    for r in runs:
        params = "-" if r["params"] is None else f"{r['params'] / 1e6:.2f}"
        cells = [r["name"], *(str(r["recipe"][k]) for k in keys), str(result["step"]), f"{r['val_loss']:.4f}",
                 f"{r['val_tau_prob']:.3f}", f"{r['tau_prob']:.3f}", params, f"{r['seconds_per_step']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="train.train_drafter --run folders")
    p.add_argument("--step", type=int, default=None, help="compare at this step (default: the last shared one)")
    p.add_argument("--json", metavar="OUT", help="write the comparison as JSON")
    args = p.parse_args(argv)
    if args.step is not None and args.step < 1:
        p.error(f"--step {args.step}: expected a step >= 1")
    result = compare([read_run(Path(f)) for f in args.runs], args.step)
    print(table(result))
    if args.json:
        from dspark_jax.io import atomic_write_text  # noqa: PLC0415

        atomic_write_text(Path(args.json), json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
