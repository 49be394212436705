"""Summarize `train.evaluate --json` reports into the README's per-domain table (markdown).

    python -m train.summarize_eval --dir runs/eval --drafts dflash dspark \
        --domains gsm8k mbpp livecodebench arena-hard mt-bench

Reads DIR/{draft}_{domain}.json. The pooled row weights every domain by its rounds: tau is the mean over all
request-rounds, and ECE is recomputed from the merged 20-bin reliability counts (exact, since both use the
same bins); AUROC is the round-weighted mean of the per-domain values (the ranking itself is not stored).

Reports with per-prompt rows (`train.evaluate` writes them) also give a 95% interval over prompts for each
tau and for the ratio of two drafters (a bootstrap that redraws the prompts of each domain, the same prompts
for both drafters), and `--first N` cuts every report to the prompts `train.evaluate --limit N` would have
chosen (tau only: the calibration bins are not kept per prompt), so a run at a larger limit compares with one
at a smaller. Sampling is keyed by request, so the cut run's prompts are decoded with the smaller run's random
draws.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dspark_jax.cli import positive_int, writable_file
from dspark_jax.io import atomic_write_text


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
    return first.get("auroc_sts", first.get("auroc_raw"))  # None for a report cut by --first


def pool(reports: list[dict]) -> dict:
    n = np.asarray([r["rounds"] for r in reports], np.float64)
    return {
        "rounds": int(n.sum()),
        "accept_len": float(np.sum(n * [r["accept_len"] for r in reports]) / n.sum()),
        "ece_raw": pooled_ece(reports, "reliability_raw"),
        "ece_sts": pooled_ece(reports, "reliability_sts"),
        "auroc": float(np.sum(n * [r["auroc"] for r in reports]) / n.sum()) if all(
            r.get("auroc") is not None for r in reports) else None,
        "first_position_auroc": float(np.sum(n * [first_position_auroc(r) for r in reports]) / n.sum()) if all(
            first_position_auroc(r) is not None for r in reports) else None,
    }


def prompt_rows(report: dict, first: int | None = None, where: str = "report") -> list[dict]:
    """The report's per-prompt rows (`evaluation.per_request`), those among the first ``first`` prompts of
    their file when given.

    Raises:
      ValueError: naming ``where`` when the report has no per-prompt rows (written before they were kept).
    """
    rows = report.get("per_request")
    if rows is None or (first is not None and any("prompt" not in r for r in rows)):
        raise ValueError(f"{where}: no per-prompt rows (rerun train.evaluate to write them)")
    return [r for r in rows if first is None or r["prompt"][1] < first]


def tau_of(rows: list[dict]) -> dict:
    """Rounds and pooled accepted length (bonus included) of per-prompt rows."""
    n = sum(r["rounds"] for r in rows)
    return {"rounds": n, "accept_len": 1.0 + sum(r["accepted"] for r in rows) / n}


def bootstrap(rows_by_drafter: dict[str, list[list[dict]]], draws: int = 2000, seed: int = 0
              ) -> dict[str, np.ndarray]:
    """Pooled tau of each drafter under ``draws`` redraws of the prompts: ``rows_by_drafter[d]`` holds one list
    of per-prompt rows per domain, the same prompts in the same order for every drafter; each draw takes every
    domain's prompts with replacement (the same indices for every drafter). Returns [draws] per drafter."""
    rng = np.random.default_rng(seed)
    names = list(rows_by_drafter)
    n_dom = len(rows_by_drafter[names[0]])
    picks = [rng.integers(0, len(rows_by_drafter[names[0]][k]), size=(draws, len(rows_by_drafter[names[0]][k])))
             for k in range(n_dom)]
    out = {}
    for d in names:
        rounds = np.zeros(draws)
        accepted = np.zeros(draws)
        for k, doms in enumerate(rows_by_drafter[d]):
            r = np.asarray([x["rounds"] for x in doms], np.float64)
            a = np.asarray([x["accepted"] for x in doms], np.float64)
            rounds += r[picks[k]].sum(axis=1)
            accepted += a[picks[k]].sum(axis=1)
        out[d] = 1.0 + accepted / rounds
    return out


def paired_rows(reports: dict, drafts: list[str], domains: list[str]) -> dict:
    """Per domain, the per-prompt rows of every drafter over the prompts all of them decoded, in one order."""
    out = {}
    for dom in domains:
        by = {d: {r["request"] if "prompt" not in r else tuple(r["prompt"]): r
                  for r in prompt_rows(reports[d, dom], where=f"{d}_{dom}.json")} for d in drafts}
        shared = sorted(set.intersection(*(set(v) for v in by.values())))
        out[dom] = {d: [by[d][k] for k in shared] for d in drafts}
    return out


def _interval(x: np.ndarray) -> list[float]:
    return [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))]


def _span(lo_hi: list[float], digits: int = 3) -> str:
    return f"{lo_hi[0]:.{digits}f}-{lo_hi[1]:.{digits}f}"


def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/eval")
    p.add_argument("--drafts", nargs="+", default=["dflash", "dspark"])
    p.add_argument("--domains", nargs="+", default=["gsm8k", "mbpp", "livecodebench", "arena-hard", "mt-bench"])
    p.add_argument("--json", metavar="OUT", type=writable_file, help="write the pooled numbers as JSON")
    p.add_argument("--first", type=positive_int, metavar="N",
                   help="only the first N prompts of each report's file (what train.evaluate --limit N chose)")
    args = p.parse_args(argv)
    reports = {}
    for d in args.drafts:
        for dom in args.domains:
            path = Path(args.dir) / f"{d}_{dom}.json"
            if not path.is_file():
                raise SystemExit(f"missing report {path}: run train.evaluate --json {path} first")
            try:
                report = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: not valid JSON ({e}); expected a train.evaluate --json report") from None
            missing = [k for k in ("rounds", "accept_len", "per_position") if not isinstance(report, dict)
                       or k not in report]
            if missing:
                raise SystemExit(f"{path}: lacks {', '.join(missing)}; expected a train.evaluate --json report")
            reports[d, dom] = report
    halves = sorted({str(r.get("half", "unrecorded")) for r in reports.values()})
    if halves != ["eval"]:  # STS is fitted on the calib half: only the eval half is held out from it
        print(f"note: the reports cover the {', '.join(halves)} half of their prompt files; only the eval half is "
              f"held out from the calibration (train.evaluate --half eval)", file=sys.stderr)
    kept = all("per_request" in r for r in reports.values())
    if args.first is not None:
        if not kept:
            raise SystemExit("--first: every report needs per-prompt rows (rerun train.evaluate to write them)")
        for (d, dom), r in list(reports.items()):  # tau only: calibration is not kept per prompt
            rows = prompt_rows(r, args.first, f"{d}_{dom}.json")
            reports[d, dom] = dict(tau_of(rows), per_request=rows, per_position=[{}], auroc=None)
    intervals = {}
    if kept:
        paired = paired_rows(reports, args.drafts, args.domains)
        for dom in args.domains + ["pooled"]:
            doms = args.domains if dom == "pooled" else [dom]
            draws = bootstrap({d: [paired[x][d] for x in doms] for d in args.drafts})
            intervals[dom] = {d: _interval(draws[d]) for d in args.drafts}
            if len(args.drafts) == 2:
                intervals[dom]["ratio"] = _interval(draws[args.drafts[1]] / draws[args.drafts[0]])
    head = ["domain", "rounds"] + [f"tau {d}" for d in args.drafts]
    head += [f"95% interval ({d})" for d in args.drafts] if intervals else []
    if len(args.drafts) == 2:
        head.append(f"{args.drafts[1]} / {args.drafts[0]}")
        head += ["95% interval"] if intervals else []
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
        if intervals:
            cells += [_span(intervals[dom][d]) for d in args.drafts]
            for d in args.drafts:
                rs[d] = dict(rs[d], tau_interval=intervals[dom][d])
        if len(args.drafts) == 2:
            cells.append(_fmt(rs[args.drafts[1]]["accept_len"] / rs[args.drafts[0]]["accept_len"], 2))
            if intervals:
                cells.append(_span(intervals[dom]["ratio"], 2))
                rs["ratio_interval"] = intervals[dom]["ratio"]
        for d in conf:
            cells += [_fmt(rs[d]["ece_raw"], 4), _fmt(rs[d]["ece_sts"], 4), _fmt(rs[d]["auroc"]),
                      _fmt(rs[d]["first_position_auroc"])]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
