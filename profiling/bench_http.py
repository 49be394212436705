"""HTTP serving benchmark: the OpenAI-compatible server under N concurrent streaming clients, against the
in-process closed loop on the same engine, in one run.

    python -m profiling.bench_http --quick                       # none and dspark at 1 and 4 clients, < 1 min
    python -m profiling.bench_http --policies none dspark --concurrency 1 16 --json runs/http.json
    python -m profiling.bench_http --url http://127.0.0.1:8000 --served-model-name SmolLM2-135M-Instruct

For each policy and N: first the in-process closed loop (`dspark_jax.serving.ClosedLoop`: N users, each sending
its next prompt when its answer ends; tokens/s over the rounds that compiled nothing, and over the wall time
less those rounds),
then the same engine behind the server on 127.0.0.1 with N streaming HTTP clients sending the same prompts
(`dspark_jax.serve.load.http_closed_loop`): tokens/s over a window of wall time, time to first token and
inter-token latency percentiles. ``ratio_http`` is the HTTP throughput over the in-process loop's (rounds);
``ratio_http_wall`` over its wall-clock throughput. With ``--url`` only the HTTP side runs, against that
server. Rows carry the machine (`timing.device_info`) and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time

from dspark_jax.build import add_model_arguments, build_engine, load_drafter_for, load_target, target_name
from dspark_jax.engine import parse_policy
from dspark_jax.serving import ClosedLoop, mixed_prompts, summarize_windows
from dspark_jax.sharding import mesh_from_args
from dspark_jax.timing import device_info, format_table, write_json

COLUMNS = ["policy", "N", "inproc_tokens_per_s", "inproc_wall_tokens_per_s", "http_tokens_per_s", "ratio_http",
           "ratio_http_wall", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "http_requests"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m profiling.bench_http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--sps", help="SPS table JSON (default: the packaged table chosen for this host)")
    p.add_argument("--policies", nargs="+", default=["none", "dspark"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--warmup-tokens", type=int, default=512, help="tokens before each measurement (per point)")
    p.add_argument("--measure-tokens", type=int, default=2048, help="tokens in each measurement window")
    p.add_argument("--prompts", help="folder of JSONL prompts (default: ../shared/data/prompts/dev or shipped)")
    p.add_argument("--url", help="drive this running server instead (HTTP side only)")
    p.add_argument("--served-model-name", help="with --url: the model id the server serves")
    p.add_argument("--api-key", help="with --url: the server's API key")
    p.add_argument("--warm-up", action="store_true",
                   help="compile every round program before measuring (else the warm-up tokens must cover it)")
    p.add_argument("--quick", action="store_true", help="none and dspark at 1 and 4 clients, short windows")
    p.add_argument("--json", metavar="PATH", help="write the rows and the machine as JSON")
    return p


def _http_row(res) -> dict:
    from dspark_jax.serve.load import percentiles  # noqa: PLC0415

    ttft, itl = percentiles(res.ttft), percentiles(res.itl)
    return {"http_tokens_per_s": res.tokens_per_s, "http_tokens": res.tokens, "http_seconds": res.seconds,
            "http_requests": res.requests, "http_errors": res.errors,
            **{f"ttft_{k}_ms": v for k, v in ttft.items()}, **{f"itl_{k}_ms": v for k, v in itl.items()}}


def inprocess(engine, prompts, n, max_new, warmup_tokens, measure_tokens) -> dict:
    """The in-process closed loop at ``n`` users on ``engine`` (left idle afterwards)."""
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
    return {"inproc_tokens_per_s": res.tokens_per_s, "inproc_wall_tokens_per_s": tokens / wall,
            "inproc_compiled_rounds": res.compiled_rounds, "accept_len": res.accept_len}


def over_http(engine, tokenizer, name, prompts, n, args) -> dict:
    """The same engine behind the server on 127.0.0.1 with ``n`` streaming clients."""
    from dspark_jax.serve import BackgroundServer, EngineWorker, create_app  # noqa: PLC0415
    from dspark_jax.serve.load import http_closed_loop  # noqa: PLC0415

    worker = EngineWorker(engine, max_queued=max(64, 2 * n))
    app = create_app(worker, tokenizer, name, default_max_tokens=args.max_new_tokens)
    try:
        with BackgroundServer(app) as url:
            res = asyncio.run(http_closed_loop(url, name, prompts, n, args.max_new_tokens,
                                               warmup_tokens=args.warmup_tokens, measure_tokens=args.measure_tokens,
                                               temperature=args.temperature))
    finally:
        engine.on_token = None
    return _http_row(res)


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.concurrency, args.max_new_tokens = [1, 4], 32
        args.warmup_tokens, args.measure_tokens, args.max_prompt_tokens = 64, 128, 256
    for pol in args.policies:
        try:
            parse_policy(pol)
        except ValueError as e:
            build_parser().error(str(e))
    if min(args.concurrency) < 1 or args.max_new_tokens < 1 or args.measure_tokens < 1:
        build_parser().error("--concurrency, --max-new-tokens and --measure-tokens must be >= 1")
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
            res = asyncio.run(http_closed_loop(args.url.rstrip("/"), name, prompts, n, args.max_new_tokens,
                                               warmup_tokens=args.warmup_tokens, measure_tokens=args.measure_tokens,
                                               temperature=args.temperature, api_key=args.api_key))
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
                row = {"policy": pol, "N": n}
                row.update(inprocess(engine, prompts, n, args.max_new_tokens, args.warmup_tokens,
                                     args.measure_tokens))
                row.update(over_http(engine, target.tokenizer, "bench", prompts, n, args))
                row["ratio_http"] = row["http_tokens_per_s"] / row["inproc_tokens_per_s"]
                row["ratio_http_wall"] = row["http_tokens_per_s"] / row["inproc_wall_tokens_per_s"]
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
