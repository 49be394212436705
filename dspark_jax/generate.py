"""Generate text with the target model, with speculative decoding (the shipped DSpark drafter by default).

    python -m dspark_jax.generate --prompt "What is 2+2?"
    python -m dspark_jax.generate --prompts data.jsonl --limit 8 --concurrency 8 --policy dspark --json out.json
    python -m dspark_jax.generate --prompt "Hi" --policy none          # plain decoding, no drafter
    python -m dspark_jax.generate --model QWEN3_FOLDER --draft DEEPSPEC_FOLDER --prompt "Hi" --trace t.jsonl

``--trace FILE`` writes one JSON line per round and request: the round index, the request, the drafted tokens
(and their text pieces) with their calibrated confidences and raw confidence logits (null in rounds where the
drafter did not run), the scheduled length, the accepted drafts and the tokens the round emitted (a request's
first token is sampled at admission, outside any round).

Policies: none, fixed:K, threshold:C, dspark (Algorithm 1 on the SPS table), dspark-async.

A prompts file holds one {"turns": ["first user turn", ...]} object per line; the first turn is used.
The chat template is applied. A single prompt is streamed to stdout; tokens/s goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

from dspark_jax.build import add_engine_arguments, engine_from_args, load_target
from dspark_jax.cli import check_engine_arguments, existing_file, positive_int, writable_file
from dspark_jax.data import parse_turns
from dspark_jax.engine import Completion, Engine
from dspark_jax.io import atomic_write_text
from dspark_jax.sharding import mesh_from_args


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First turns of a JSONL prompts file ({"turns": [...]} per line), at most `limit` of them."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            prompts.append(parse_turns(line, f"{path}:{n}")[0])
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def run_traced(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int, path: str | Path,
               tokenizer=None) -> list[Completion]:
    """`Engine.run` that writes a JSON line per round and request to ``path`` (line-buffered, as the rounds
    run: a trace of an interrupted run holds every finished round). Request ids are the prompts' indices when
    the engine starts idle. With a tokenizer each record also holds ``drafted_text``, each drafted token's text.

    Returns:
      the completions in prompt order.
    """
    engine.record_confidences = engine.record_tokens = True
    ids = [engine.submit(p, max_new_tokens) for p in prompt_ids]
    with open(path, "w", encoding="utf-8", buffering=1) as f:
        while not engine.idle():
            stats = engine.step().stats
            if stats is None:
                continue
            for row in stats.trace_rows(len(engine.rounds) - 1):
                if tokenizer is not None and row["drafted"] is not None:
                    row["drafted_text"] = [tokenizer.decode([t]) for t in row["drafted"]]
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return [engine.requests[i] for i in ids]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], help="a user prompt (repeatable)")
    p.add_argument("--prompts", type=existing_file, help="JSONL file of {\"turns\": [...]} lines (first turn used)")
    p.add_argument("--limit", type=positive_int, help="use at most this many prompts from --prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    add_engine_arguments(p)
    p.add_argument("--concurrency", "--num-slots", "--max-num-seqs", dest="concurrency", type=positive_int,
                   help="requests decoded together (default: min(prompts, 16), rounded up to a multiple of "
                        "--data-parallel-size)")
    p.add_argument("--json", dest="json_out", type=writable_file, help="write results and speed to this JSON file")
    p.add_argument("--quiet", action="store_true", help="do not stream or print generated text")
    p.add_argument("--trace", type=writable_file,
                   help="write per round and request the drafted tokens, confidences, scheduled length and accepted "
                        "count to this file (JSON lines)")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    prompts = list(args.prompt)
    if args.prompts:
        try:
            prompts += read_prompts(args.prompts, args.limit)
        except (ValueError, OSError) as e:
            p.error(f"--prompts: {e}")
    if not prompts:
        p.error("give --prompt TEXT or --prompts FILE.jsonl")
    check_engine_arguments(p, args)
    mesh = mesh_from_args(args)  # before anything touches JAX (a multi-process run joins here)
    if not args.concurrency:  # the default: a slot a prompt up to 16, a whole number of slots per data group
        groups = args.data_parallel_size or 1
        args.concurrency = -(-min(len(prompts), 16) // groups) * groups
    if mesh is None:
        model = load_target(args.model, dtype=args.dtype)
    else:
        model = load_target(args.model, dtype=args.dtype, mesh=mesh)
    tok = model.tokenizer
    prompt_ids = [tok.encode_chat([p]) for p in prompts]
    engine = engine_from_args(args, model, num_slots=args.concurrency,
                              max_prompt_tokens=max(len(p) for p in prompt_ids), max_new_tokens=args.max_new_tokens,
                              mesh=mesh)

    if len(prompts) == 1 and not args.quiet:
        stream = tok.stream()

        def on_token(_, token):
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

        engine.on_token = on_token
    t0 = time.perf_counter()
    if args.trace:
        results = run_traced(engine, prompt_ids, args.max_new_tokens, args.trace, tok)
    else:
        results = engine.run(prompt_ids, args.max_new_tokens)
    wall = time.perf_counter() - t0
    if engine.on_token is not None:
        sys.stdout.write(stream.flush() + "\n")
    elif not args.quiet:
        for prompt, r in zip(prompts, results):
            print(f"### {prompt}\n{tok.decode(r.output_ids)}\n")
    summ = engine.summary()
    print(f"policy {engine.policy}: {summ['emitted_tokens']} tokens, {summ['tokens_per_s']:.1f} tokens/s in steady "
          f"rounds ({summ['compiled_rounds']} of {summ['rounds']} rounds compiled and are excluded; wall "
          f"{wall:.1f} s), accepted length {summ.get('accept_len', 1.0):.2f}, "
          f"drafts per request {summ.get('drafts_per_request', 0.0):.2f}", file=sys.stderr)
    report = {
        "results": [{"prompt": p, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                     "text": tok.decode(r.output_ids)} for p, r in zip(prompts, results)],
        "tokens_per_s": summ["tokens_per_s"],
        "summary": summ,
        "wall_seconds": wall,
        "policy": str(engine.policy), "draft": args.draft if engine.policy.drafts else None,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
        "concurrency": args.concurrency,
    }
    if args.json_out and jax.process_index() == 0:  # under jax.distributed every process holds the same results
        atomic_write_text(args.json_out, json.dumps(report, ensure_ascii=False, indent=1))
    return report


if __name__ == "__main__":
    main()
