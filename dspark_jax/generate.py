"""Generate text with the target model, with speculative decoding (the shipped DSpark drafter by default).

    python -m dspark_jax.generate --prompt "What is 2+2?"
    python -m dspark_jax.generate --prompts data.jsonl --limit 8 --concurrency 8 --policy dspark --json out.json
    python -m dspark_jax.generate --prompt "Hi" --policy none          # plain decoding, no drafter

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

from dspark_jax.build import add_engine_arguments, engine_from_args, load_target
from dspark_jax.data import parse_turns
from dspark_jax.engine import parse_policy


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], help="a user prompt (repeatable)")
    p.add_argument("--prompts", help="JSONL file of {\"turns\": [...]} lines (first turn used)")
    p.add_argument("--limit", type=int, help="use at most this many prompts from --prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    add_engine_arguments(p)
    p.add_argument("--concurrency", "--num-slots", dest="concurrency", type=int,
                   help="requests decoded together (default: min(prompts, 16))")
    p.add_argument("--json", dest="json_out", help="write results and speed to this JSON file")
    p.add_argument("--quiet", action="store_true", help="do not stream or print generated text")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    prompts = list(args.prompt)
    if args.prompts:
        prompts += read_prompts(args.prompts, args.limit)
    if not prompts:
        build_parser().error("give --prompt TEXT or --prompts FILE.jsonl")
    if args.max_new_tokens < 1:
        build_parser().error("--max-new-tokens must be >= 1")
    args.concurrency = args.concurrency or min(len(prompts), 16)
    try:
        parse_policy(args.policy)
    except ValueError as e:
        build_parser().error(str(e))
    model = load_target(args.model, dtype=args.dtype)
    tok = model.tokenizer
    prompt_ids = [tok.encode_chat([p]) for p in prompts]
    engine = engine_from_args(args, model, num_slots=args.concurrency,
                              max_prompt_tokens=max(len(p) for p in prompt_ids), max_new_tokens=args.max_new_tokens)

    if len(prompts) == 1 and not args.quiet:
        stream = tok.stream()

        def on_token(_, token):
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

        engine.on_token = on_token
    t0 = time.perf_counter()
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
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
