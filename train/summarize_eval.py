"""Summarize `train.evaluate --json` reports into the README's per-domain table (markdown).

    python -m train.summarize_eval --dir runs/eval --drafts dflash dspark \
        --domains gsm8k mbpp livecodebench arena-hard mt-bench

Reads DIR/{draft}_{domain}.json. The pooled row weights every domain by its rounds: tau is the mean over all
request-rounds, and ECE is recomputed from the merged 20-bin reliability counts (exact, since both use the
same bins); AUROC is the round-weighted mean of the per-domain values (the ranking itself is not stored).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def pooled_ece(reports: list[dict], key: str) -> float | None:
    """ECE of the union of the reports' rounds, from their reliability bins (count, mean pred, mean obs)."""
    if any(r.get(key) is None for r in reports):
        return None
    cnt = sum(np.asarray(r[key]["count"]) for r in reports)
    sp = sum(np.asarray(r[key]["count"]) * np.asarray(r[key]["pred"]) for r in reports)
    so = sum(np.asarray(r[key]["count"]) * np.asarray(r[key]["obs"]) for r in reports)
    return float(np.sum(np.abs(sp - so)) / np.sum(cnt))


def first_position_auroc(report: dict) -> float:
    """AUROC at block position 1 (after STS when the report has it)."""
    first = report["per_position"][0]
    return first.get("auroc_sts", first.get("auroc_raw"))


def pool(reports: list[dict]) -> dict:
    n = np.asarray([r["rounds"] for r in reports], np.float64)
    return {
        "rounds": int(n.sum()),
        "accept_len": float(np.sum(n * [r["accept_len"] for r in reports]) / n.sum()),
        "ece_raw": pooled_ece(reports, "reliability_raw"),
        "ece_sts": pooled_ece(reports, "reliability_sts"),
        "auroc": float(np.sum(n * [r["auroc"] for r in reports]) / n.sum()) if all(
            r.get("auroc") is not None for r in reports) else None,
        "first_position_auroc": float(np.sum(n * [first_position_auroc(r) for r in reports]) / n.sum()),
    }


def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/eval")
    p.add_argument("--drafts", nargs="+", default=["dflash", "dspark"])
    p.add_argument("--domains", nargs="+", default=["gsm8k", "mbpp", "livecodebench", "arena-hard", "mt-bench"])
    p.add_argument("--json", metavar="OUT", help="write the pooled numbers as JSON")
    args = p.parse_args(argv)
    reports = {}
    for d in args.drafts:
        for dom in args.domains:
            path = Path(args.dir) / f"{d}_{dom}.json"
            if not path.is_file():
                raise SystemExit(f"missing report {path}: run train.evaluate --json {path} first")
            reports[d, dom] = json.loads(path.read_text())
    head = ["domain", "rounds"] + [f"tau {d}" for d in args.drafts]
    if len(args.drafts) == 2:
        head.append(f"{args.drafts[1]} / {args.drafts[0]}")
    conf = [d for d in args.drafts if reports[d, args.domains[0]].get("ece_sts") is not None]
    for d in conf:
        head += [f"ECE raw ({d})", f"ECE STS ({d})", f"AUROC ({d})", f"AUROC pos. 1 ({d})"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    out = {}
    for dom in args.domains + ["pooled"]:
        if dom == "pooled":
            rs = {d: pool([reports[d, x] for x in args.domains]) for d in args.drafts}
        else:
            rs = {d: dict(reports[d, dom], first_position_auroc=first_position_auroc(reports[d, dom]))
                  for d in args.drafts}
        out[dom] = rs
        cells = [f"**{dom}**" if dom == "pooled" else dom, "/".join(str(rs[d]["rounds"]) for d in args.drafts)]
        cells += [_fmt(rs[d]["accept_len"]) for d in args.drafts]
        if len(args.drafts) == 2:
            cells.append(_fmt(rs[args.drafts[1]]["accept_len"] / rs[args.drafts[0]]["accept_len"], 2))
        for d in conf:
            cells += [_fmt(rs[d]["ece_raw"], 4), _fmt(rs[d]["ece_sts"], 4), _fmt(rs[d]["auroc"]),
                      _fmt(rs[d]["first_position_auroc"])]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
