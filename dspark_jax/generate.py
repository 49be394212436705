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

from dspark_jax.drafters import prior_confidence, resolve_drafter
from dspark_jax.engine import Engine, EngineConfig, parse_policy
from dspark_jax.models.gguf import MODEL_FILE
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
    p.add_argument("--policy", default="dspark", help="none | fixed:K | threshold:C | dspark | dspark-async")
    p.add_argument("--draft", default="dspark", help="dspark | dflash | a drafter folder (ignored by --policy none)")
    p.add_argument("--sps", help="SPS table JSON (default: the shipped table measured on a 2-core CPU)")
    p.add_argument("--concurrency", "--num-slots", dest="concurrency", type=int,
                   help="requests decoded together (default: min(prompts, 16))")
    p.add_argument("--json", dest="json_out", help="write results and speed to this JSON file")
    p.add_argument("--model", help="path to a Llama-family GGUF (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--quiet", action="store_true", help="do not stream or print generated text")
    return p


def build_engine(model, args, max_prompt: int) -> Engine:
    """The engine for the command-line options (shared with the benchmark and the demo)."""
    policy = parse_policy(args.policy)
    drafter = temps = sps = None
    prior = EngineConfig.prior_confidence
    if policy.drafts:
        drafter, _, temps, path = resolve_drafter(args.draft, target_cfg=model.cfg)
        prior = prior_confidence(path, prior)
    block = drafter.cfg.block if drafter is not None else 1
    if policy.kind in ("dspark", "dspark-async"):
        from dspark_jax.sps import default_sps_table, load_sps_table  # noqa: PLC0415

        name = Path(args.model).name if args.model else MODEL_FILE
        sps = load_sps_table(args.sps, model=name, block=block) if args.sps else default_sps_table(model=name)
    capacity = -(-(max_prompt + args.max_new_tokens + block + 1) // 128) * 128
    cfg = EngineConfig(num_slots=args.concurrency, capacity=capacity, temperature=args.temperature, seed=args.seed,
                       prior_confidence=prior)
    return Engine(model, drafter, policy, cfg, sts_temperatures=temps, sps=sps)


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
    model = LlamaModel.from_gguf(args.model)
    tok = model.tokenizer
    prompt_ids = [tok.encode_chat([p]) for p in prompts]
    engine = build_engine(model, args, max(len(p) for p in prompt_ids))

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
