"""HTTP serving benchmark: the OpenAI-compatible server under N concurrent streaming clients, against the
in-process closed loop on the same engine, in one run.

    python -m profiling.bench_http --quick                       # none and dspark at 2 clients, < 1 min
    python -m profiling.bench_http --policies none dspark --concurrency 1 16 --json runs/http.json
    python -m profiling.bench_http --url http://127.0.0.1:8000 --served-model-name SmolLM2-135M-Instruct

For each policy and N, ``--repeats`` pairs of windows, in turns (in-process then HTTP, then HTTP then in-process,
...: a CPU whose speed drifts within minutes moves both sides of a pair alike): the in-process closed loop
(`dspark_jax.serving.ClosedLoop`: N users, each sending its next prompt when its answer ends; tokens over the
wall time less the rounds that compiled), and the same engine behind the server on 127.0.0.1 with N streaming
HTTP clients sending the same prompts from a separate process (`dspark_jax.serve.load.http_closed_loop_process`:
tokens over a window of wall time, time to first token and inter-token latency percentiles). ``ratio_http`` is the
HTTP throughput over the in-process one pooled over the pairs, with a paired bootstrap 95% interval
(``ratio_lo``, ``ratio_hi``); ``ratio_median`` the median of the per-pair ratios. The in-process side leaves out
the rounds that compiled; an HTTP window in which the server compiled is measured again (up to twice;
``http_compiled_rounds`` counts them). With ``--url`` only the HTTP side runs, against that server. Rows carry the machine (`timing.device_info`) and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time

import numpy as np

from dspark_jax.build import add_model_arguments, build_engine, load_drafter_for, load_target, target_name
from dspark_jax.cli import nonnegative_int, parse_with_quick, positive_int, temperature
from dspark_jax.engine import parse_policy
from dspark_jax.serving import ClosedLoop, mixed_prompts, summarize_windows
from dspark_jax.sharding import mesh_from_args
from dspark_jax.timing import device_info, format_table, write_json

COLUMNS = ["policy", "N", "pairs", "inproc_tokens_per_s", "http_tokens_per_s", "ratio_http", "ratio_lo", "ratio_hi",
           "ratio_median", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "http_requests",
           "http_compiled_rounds"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m profiling.bench_http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--sps", help="SPS table JSON (default: the packaged table chosen for this host)")
    p.add_argument("--policies", nargs="+", default=["none", "dspark"])
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--temperature", type=temperature, default=0.0)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    p.add_argument("--warmup-tokens", type=nonnegative_int, default=None,
                   help="tokens before each measurement window (default: 64 x N)")
    p.add_argument("--measure-tokens", type=positive_int, default=None,
                   help="tokens in each measurement window (default: 128 x N, at least 512)")
    p.add_argument("--repeats", type=positive_int, default=4, help="pairs of windows (in-process, HTTP) per point")
    p.add_argument("--prompts", help="folder of JSONL prompts (default: ../shared/data/prompts/dev or shipped)")
    p.add_argument("--url", help="drive this running server instead (HTTP side only)")
    p.add_argument("--served-model-name", help="with --url: the model id the server serves")
    p.add_argument("--api-key", help="with --url: the server's API key")
    p.add_argument("--warm-up", action="store_true",
                   help="compile every round program before measuring (else the warm-up tokens must cover it)")
    p.add_argument("--no-burn-in", dest="burn_in", action="store_false",
                   help="skip the unmeasured pair of windows before each point (compiles land in measured windows)")
    p.add_argument("--quick", action="store_true",
                   help="none and dspark at 2 clients, short windows, 1 pair, no burn-in")
    p.add_argument("--json", metavar="PATH", help="write the rows and the machine as JSON")
    return p


def _http_row(results) -> dict:
    """The HTTP side of a point from its windows (`HTTPLoadResult`s): tokens/s pooled over them, latency
    percentiles over every token of every window."""
    from dspark_jax.serve.load import percentiles  # noqa: PLC0415

    tokens, seconds = sum(r.tokens for r in results), sum(r.seconds for r in results)
    ttft = percentiles([t for r in results for t in r.ttft])
    itl = percentiles([t for r in results for t in r.itl])
    return {"http_tokens_per_s": tokens / seconds if seconds > 0 else float("nan"), "http_tokens": tokens,
            "http_seconds": seconds, "http_requests": sum(r.requests for r in results),
            "http_errors": sum(r.errors for r in results),
            "http_windows": [[r.tokens, r.seconds] for r in results],
            **{f"ttft_{k}_ms": v for k, v in ttft.items()}, **{f"itl_{k}_ms": v for k, v in itl.items()}}


def inprocess(engine, prompts, n, max_new, warmup_tokens, measure_tokens) -> dict:
    """One window of the in-process closed loop at ``n`` users on ``engine`` (left idle afterwards): tokens and
    wall seconds less the rounds that compiled, tokens/s over the steady rounds alone, accepted length."""
    loop = ClosedLoop(engine, prompts, n, max_new)
    loop.run_until(warmup_tokens)
    start, t0 = loop.emitted, time.perf_counter()
    rounds = loop.run_until(warmup_tokens + measure_tokens)
    wall = time.perf_counter() - t0
    res = summarize_windows([rounds])
    # wall clock without the rounds that compiled (their time is compile time)
    compiled = [r for r in rounds if r.compiled]
    wall -= sum(r.seconds for r in compiled)
    tokens = loop.emitted - start - sum(r.emitted for r in compiled)
    while not engine.idle():  # finish what the users still had in flight
        engine.step()
    return {"tokens": tokens, "seconds": wall, "rounds_tokens_per_s": res.tokens_per_s,
            "compiled_rounds": res.compiled_rounds, "accept_len": res.accept_len}


def over_http(engine, tokenizer, name, prompts, n, args):
    """One window of the same engine behind the server on 127.0.0.1 with ``n`` streaming clients: an
    `HTTPLoadResult` and the server's count of rounds that compiled (their time is inside the window)."""
    from dspark_jax.serve import BackgroundServer, EngineWorker, create_app  # noqa: PLC0415
    from dspark_jax.serve.load import http_closed_loop_process  # noqa: PLC0415

    worker = EngineWorker(engine, max_queued=max(64, 2 * n))
    app = create_app(worker, tokenizer, name, default_max_tokens=args.max_new_tokens)
    try:
        with BackgroundServer(app) as url:  # the clients run in a process of their own, as a load generator does
            res = http_closed_loop_process(url, name, prompts, n, args.max_new_tokens,
                                           warmup_tokens=warmup_tokens(args, n), measure_tokens=window_tokens(args, n),
                                           temperature=args.temperature)
    finally:
        engine.on_token = None
    return res, worker.metrics().compiled_rounds


def window_tokens(args, n: int) -> int:
    return args.measure_tokens if args.measure_tokens is not None else max(512, 128 * n)


def warmup_tokens(args, n: int) -> int:
    return args.warmup_tokens if args.warmup_tokens is not None else 64 * n


def paired_point(engine, tokenizer, prompts, n, args) -> dict:
    """``args.repeats`` pairs of windows at ``n`` clients, in-process and HTTP in turns (ABBA ...)."""
    from dspark_jax.serving import pooled_ratio  # noqa: PLC0415

    local, remote, compiled = [], [], 0
    if args.burn_in:  # one unmeasured window of each, so that the shapes both paths meet have compiled
        inprocess(engine, prompts, n, args.max_new_tokens, warmup_tokens(args, n), window_tokens(args, n))
        over_http(engine, tokenizer, "bench", prompts, n, args)
    for r in range(args.repeats):
        for side in (("local", "http") if r % 2 == 0 else ("http", "local")):
            if side == "local":
                local.append(inprocess(engine, prompts, n, args.max_new_tokens, warmup_tokens(args, n),
                                       window_tokens(args, n)))
            else:
                for _ in range(3):  # a window in which the server compiled is not steady state: once more
                    res, c = over_http(engine, tokenizer, "bench", prompts, n, args)
                    if not c:
                        break
                    compiled += c
                remote.append(res)
    row = {"pairs": args.repeats}
    tokens, seconds = sum(w["tokens"] for w in local), sum(w["seconds"] for w in local)
    row["inproc_tokens_per_s"] = tokens / seconds
    row["inproc_windows"] = [[w["tokens"], w["seconds"]] for w in local]
    row["inproc_compiled_rounds"] = sum(w["compiled_rounds"] for w in local)
    row["accept_len"] = float(np.mean([w["accept_len"] for w in local]))
    row.update(_http_row(remote), http_compiled_rounds=compiled)  # in windows measured again
    ratio, lo, hi = pooled_ratio([r.tokens for r in remote], [r.seconds for r in remote],
                                 [w["tokens"] for w in local], [w["seconds"] for w in local])
    row.update(ratio_http=ratio, ratio_lo=lo, ratio_hi=hi, ratio_median=float(np.median(
        [(r.tokens / r.seconds) / (w["tokens"] / w["seconds"]) for r, w in zip(remote, local)])))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_with_quick(build_parser(), argv, concurrency=[2], max_new_tokens=16, repeats=1, burn_in=False,
                            warmup_tokens=16, measure_tokens=48, max_prompt_tokens=128)
    for pol in args.policies:
        try:
            parse_policy(pol)
        except ValueError as e:
            build_parser().error(str(e))
    mesh = mesh_from_args(args)
    target = load_target(args.model, dtype=args.dtype, mesh=mesh)
    prompts = [ids for _, ids in mixed_prompts(target.tokenizer, args.prompts, max_prompt_tokens=args.max_prompt_tokens)]
    meta = {"device": device_info(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": vars(args)}
    rows = []
    if args.url:
        from dspark_jax.serve.load import http_closed_loop  # noqa: PLC0415

        name = args.served_model_name or target_name(args.model).rsplit(".gguf", 1)[0].split(".Q")[0]
        for n in args.concurrency:
            res = [asyncio.run(http_closed_loop(args.url.rstrip("/"), name, prompts, n, args.max_new_tokens,
                                                warmup_tokens=warmup_tokens(args, n),
                                                measure_tokens=window_tokens(args, n),
                                                temperature=args.temperature, api_key=args.api_key))
                   for _ in range(args.repeats)]
            rows.append({"policy": "(server)", "N": n, **_http_row(res)})
    else:
        loaded = None
        for pol in args.policies:
            if parse_policy(pol).drafts and loaded is None:
                loaded = load_drafter_for(target, args.draft)
            engine = build_engine(target, pol, draft=loaded, sps=args.sps, num_slots=max(args.concurrency),
                                  max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, model_name=target_name(args.model), mesh=mesh)
            if args.warm_up:
                engine.warm_up(max(len(p) for p in prompts))
            for n in args.concurrency:
                row = {"policy": pol, "N": n, **paired_point(engine, target.tokenizer, prompts, n, args)}
                rows.append(row)
                print(format_table([row], COLUMNS), file=sys.stderr)
                if args.json:
                    write_json(args.json, {**meta, "rows": rows, "complete": False})
    print(f"{meta['date']}  {meta['device']}")
    print(format_table(rows, [c for c in COLUMNS if any(c in r for r in rows)]))
    if args.json:
        write_json(args.json, {**meta, "rows": rows, "complete": True})
    return rows


if __name__ == "__main__":
    main()
