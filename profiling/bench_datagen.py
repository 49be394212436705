"""Training-data generation throughput: `dspark_jax.datagen` (continuous batching over many slots, a prompt
prefilled once for all its answers) against chunked plain decoding (`decoding.plain_generate` over chunks of
prompts, one answer each: the generator the shipped drafters were trained with), on the same prompts, in one run.

    python -m profiling.bench_datagen --quick          # < 1 min
    python -m profiling.bench_datagen --prompts 48 --json runs/datagen_bench.json

Both sides compile before their clock starts (every decode context, the prefill chunks, the samplers). Answer
tokens per second of each, and the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.cli import parse_with_quick, positive_int, temperature
from dspark_jax.data import load_prompts
from dspark_jax.datagen import generate_responses
from dspark_jax import decoding
from dspark_jax.decoding import plain_generate
from dspark_jax.models.llama import CONTEXT_STEP, PREFILL_CHUNKS, context_bucket
from dspark_jax.serving import shipped_prompts_dir
from dspark_jax.timing import device_info, format_table, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m profiling.bench_datagen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, draft=False)
    p.add_argument("--prompt-dir", help="folder of JSONL prompts (default: the training prompts or the shipped ones)")
    p.add_argument("--prompts", type=positive_int, default=48, help="prompts answered by each side")
    p.add_argument("--samples", type=temperature, nargs="+", default=[0.0, 1.0, 1.0, 1.0, 1.0])
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=1024)
    p.add_argument("--slots", type=positive_int, default=64, help="the new generator's slots")
    p.add_argument("--old-slots", type=positive_int, default=24, help="chunked plain decoding's slots")
    p.add_argument("--old-chunk", type=positive_int, default=96, help="chunked plain decoding's prompts per chunk")
    p.add_argument("--quick", action="store_true", help="8 prompts, 32 new tokens, 16 and 8 slots")
    p.add_argument("--json", metavar="PATH")
    return p


def warm_up_generator(model, slots: int, capacity: int) -> None:
    """Compile what `generate_responses` runs on a (slots, capacity) cache: every decode context, the prefill
    chunks, the prompt copy, the samplers (one temperature per row)."""
    decoding.warm_up(model, model.init_cache(slots, capacity), prefill_sizes=[c for c in PREFILL_CHUNKS if c <= capacity],
                     contexts=range(CONTEXT_STEP, capacity + 1, CONTEXT_STEP), temperature=jnp.zeros(slots), copy=True)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_with_quick(build_parser(), argv, prompts=8, max_new_tokens=32, slots=16, old_slots=8)
    model = load_target(args.model, dtype=args.dtype)
    tok = model.tokenizer
    train = Path("../shared/data/prompts/train")
    prompts = load_prompts([args.prompt_dir or (train if train.is_dir() else shipped_prompts_dir())])
    prompts = [prompts[i] for i in np.random.default_rng(0).permutation(len(prompts))]
    prompts = [p for p in prompts if len(tok.encode_chat([p.turns[0]])) <= args.max_prompt_tokens][: args.prompts]
    rows = []

    # chunked plain decoding: one answer per prompt at T = 1, chunk by chunk (each chunk drains before the next)
    ids = [tok.encode_chat([p.turns[0]]) for p in prompts]
    tokens, seconds = 0, 0.0
    for c in range(0, len(ids), args.old_chunk):
        _, stats = plain_generate(model, ids[c:c + args.old_chunk], args.max_new_tokens, 1.0, num_slots=args.old_slots)
        tokens, seconds = tokens + stats.generated_tokens, seconds + stats.seconds
    rows.append({"generator": f"chunked plain decoding, {args.old_slots} slots", "answers": len(ids),
                 "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})

    capacity = context_bucket(args.max_prompt_tokens + args.max_new_tokens, 1 << 30)
    warm_up_generator(model, args.slots, capacity)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        s = generate_responses(model, prompts, out, temperatures=args.samples, max_new_tokens=args.max_new_tokens,
                               max_prompt_tokens=args.max_prompt_tokens, num_slots=args.slots,
                               shard_prompts=len(prompts), progress=False, log=lambda m: None)
        wall = time.perf_counter() - t0
    rows.append({"generator": f"datagen, {args.slots} slots, {len(args.samples)} answers per prompt",
                 "answers": len(prompts) * len(args.samples), "tokens": s["tokens"], "seconds": wall,
                 "tokens_per_s": s["tokens"] / wall})
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"{date}  {device_info()}")
    print(format_table(rows, ["generator", "answers", "tokens", "seconds", "tokens_per_s"]))
    print(f"datagen / chunked plain decoding: {ratio:.2f} x tokens/s")
    if args.json:
        write_json(args.json, {"date": date, "device": device_info(), "args": vars(args), "rows": rows,
                               "ratio": ratio})
    return rows


if __name__ == "__main__":
    main()
