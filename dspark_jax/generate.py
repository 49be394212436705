"""Generate text with the target model (plain batched decoding).

    python -m dspark_jax.generate --prompt "What is 2+2?"
    python -m dspark_jax.generate --prompts data.jsonl --limit 8 --json out.json

A prompts file holds one {"turns": ["first user turn", ...]} object per line; the first turn is used.
The chat template is applied. A single prompt is streamed to stdout; tokens/s goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark_jax.decoding import plain_generate
from dspark_jax.models.llama import LlamaModel


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First turns of a JSONL prompts file ({"turns": [...]} per line), at most `limit` of them."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'turns' list ({e})") from e
            if not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{n}: 'turns' must hold at least one string")
            prompts.append(turns[0])
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
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-slots", type=int, help="requests decoded together (default: min(prompts, 16))")
    p.add_argument("--json", dest="json_out", help="write results and tokens/s to this JSON file")
    p.add_argument("--model", help="path to a Llama-family GGUF (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--quiet", action="store_true", help="do not stream or print generated text")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    prompts = list(args.prompt)
    if args.prompts:
        prompts += read_prompts(args.prompts, args.limit)
    if not prompts:
        build_parser().error("give --prompt TEXT or --prompts FILE.jsonl")
    model = LlamaModel.from_gguf(args.model)
    tok = model.tokenizer
    prompt_ids = [tok.encode_chat([p]) for p in prompts]

    on_token = None
    if len(prompts) == 1 and not args.quiet:
        stream = tok.stream()

        def on_token(_, token):
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

    results, stats = plain_generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.seed,
                                    args.num_slots or min(len(prompts), 16), on_token=on_token)
    if on_token is not None:
        sys.stdout.write(stream.flush() + "\n")
    elif not args.quiet:
        for prompt, r in zip(prompts, results):
            print(f"### {prompt}\n{tok.decode(r.output_ids)}\n")
    print(f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_s:.1f} tokens/s "
          f"({len(prompts)} prompts, {stats.decode_steps} decode steps)", file=sys.stderr)
    report = {
        "results": [{"prompt": p, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                     "text": tok.decode(r.output_ids)} for p, r in zip(prompts, results)],
        "tokens_per_s": stats.tokens_per_s,
        "generated_tokens": stats.generated_tokens,
        "seconds": stats.seconds,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
