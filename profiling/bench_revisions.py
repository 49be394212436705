"""One benchmark, two revisions of the code, in turns: is this checkout at least as fast as an earlier commit?

    python -m profiling.bench_revisions --base a55f2f6 --json runs/ab.json -- --concurrency 1 16 \
        --policies none dspark --temperatures 0 1
    python -m profiling.bench_revisions --base a55f2f6 --quick

The base revision is checked out into a temporary git worktree; `profiling.bench_serving` (with the options after
``--``) runs from it and from this checkout in turns, base first, ``--turns`` times each, every run its own
process on the same machine (a host whose speed drifts slows both sides of a turn alike). For every point
(temperature, users, policy): tokens/s of each run, and the ratio this checkout / base, turn by turn and their
median. ``--quick``: one turn of ``bench_serving --quick``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from dspark_jax.cli import positive_int, writable_file
from dspark_jax.timing import device_info, format_table, write_json

ROOT = Path(__file__).resolve().parent.parent


def run_serving(checkout: Path, options: list[str], out: Path) -> dict:
    """`profiling.bench_serving` run from ``checkout`` (its own ``dspark_jax`` first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "profiling.bench_serving", *options, "--json", str(out)]
    subprocess.run(cmd, cwd=checkout, env=env, check=True)
    return json.loads(out.read_text())


def points(report: dict) -> dict[tuple, float]:
    """(temperature, users, policy) -> tokens/s (pooled over the windows where the report has it)."""
    out = {}
    for r in report["rows"]:
        speed = r.get("tokens_per_s_pooled", r["tokens_per_s"])
        out[(float(r["temperature"]), int(r["concurrency"]), str(r["policy"]))] = float(speed)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the earlier revision (a commit, tag or branch)")
    p.add_argument("--turns", type=positive_int, default=2)
    p.add_argument("--quick", action="store_true", help="one turn of bench_serving --quick")
    p.add_argument("--json", type=writable_file)
    args = p.parse_args(argv)
    subprocess.run(["git", "rev-parse", "--verify", f"{args.base}^{{commit}}"], cwd=ROOT, check=True,
                   capture_output=True)
    options = ["--quick", *rest] if args.quick else rest
    turns = 1 if args.quick else args.turns
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="dspark-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for turn in range(turns):
                for side, checkout in (("base", base), ("head", ROOT)):
                    print(f"turn {turn + 1}/{turns}: {side}", flush=True)
                    report = run_serving(checkout, options, Path(tmp) / f"{side}{turn}.json")
                    runs[side].append(points(report))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    rows = []
    for key in sorted(runs["base"][0]):
        ratios = [h[key] / b[key] for b, h in zip(runs["base"], runs["head"]) if key in h and key in b]
        rows.append({"temperature": key[0], "users": key[1], "policy": key[2],
                     "base_tok_s": [round(b[key], 1) for b in runs["base"]],
                     "head_tok_s": [round(h[key], 1) for h in runs["head"] if key in h],
                     "head_over_base": [round(r, 3) for r in ratios],
                     "median_ratio": round(float(np.median(ratios)), 3) if ratios else None})
    print(format_table(rows, ["temperature", "users", "policy", "base_tok_s", "head_tok_s", "head_over_base",
                              "median_ratio"]))
    if args.json:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        write_json(args.json, {"device": device_info(), "date": datetime.datetime.now().isoformat(timespec="minutes"),
                               "base": args.base, "head": head.stdout.strip(), "options": options, "rows": rows})


if __name__ == "__main__":
    main()
