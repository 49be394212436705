"""Target model speed: plain decode tokens/s against concurrent slots, packed-verification step time against T,
and both beside the weights-only floor at the same token count.

    python -m profiling.bench_target [--quick] [--json out.json] [--model GGUF|HF_FOLDER] [--dtype auto]

Floor table (`dspark_jax.stages.target_step_rows`): at contexts 256 and 1024 and 1, 4, 16, 64 slots (quick:
1 and 4 slots), the decode step (one token per slot) and the verification of 8 tokens per slot, each timed
in turns with the weights-only program (the same per-layer weight matmuls and LM head, no attention, no
cache) at the same token count; ratio = step / floor, both measured in this run. ``--quick`` prints this
table only.

Every slot holds `--context` committed tokens (one real prompt's K/V, copied to all slots). Decode: one token
per slot per step. Verification: T tokens spread round-robin over 16 slots, with the per-token cache gather
(max_per_slot None) and the slot grid (max_per_slot = ceil(T / 16)). Compilation is excluded (warm-up calls);
medians of repeated, blocked calls.
"""

from __future__ import annotations

import argparse
import datetime

import jax.numpy as jnp
import numpy as np

from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.models.llama import LlamaModel, bucket_for, decode_step, forward_packed
from dspark_jax.stages import target_step_rows
from dspark_jax.timing import device_info, format_table, time_call, write_json
from dspark_jax.cli import positive_int, writable_file


def filled_cache(model: LlamaModel, num_slots: int, capacity: int, context: int):
    """A cache whose every slot holds the same `context` tokens of real text."""
    text = "The quick brown fox jumps over the lazy dog. " * (context // 8 + 1)
    ids = model.tokenizer.encode(text)[:context]
    _, _, cache = model.prefill(model.init_cache(1, capacity), ids, 0)
    spread = lambda a: jnp.broadcast_to(a, (num_slots, *a.shape[1:])) + 0  # slot 0's entries in every slot
    return cache.replace(k=tuple(map(spread, cache.k)), v=tuple(map(spread, cache.v)),
                         lengths=jnp.full((num_slots,), context, jnp.int32))


def bench_decode(model, slots_list, context, repeats):
    rows = []
    for S in slots_list:
        state = {"cache": filled_cache(model, S, bucket_for(context + 64), context)}
        tokens, active = jnp.zeros(S, jnp.int32), jnp.ones(S, bool)

        def step():
            logits, _, cache = decode_step(model.weights, state["cache"], tokens, active, model.cfg)
            state["cache"] = cache.replace(lengths=cache.lengths - 1)  # stay at the same context length
            return logits

        t = time_call(step, repeats=repeats, warmup=2)
        rows.append({"bench": "decode", "slots": S, "context": context, "capacity": state["cache"].capacity,
                     "step_ms": 1e3 * t.median, "p25_ms": 1e3 * t.p25, "p75_ms": 1e3 * t.p75,
                     "tokens_per_s": S / t.median})
    return rows


def bench_verify(model, sizes, context, num_slots, repeats, modes):
    rows = []
    for T in sizes:
        per_slot = -(-T // num_slots)
        state = {"cache": filled_cache(model, num_slots, bucket_for(context + per_slot), context)}
        idx = np.arange(T)
        args = (jnp.asarray(np.full(T, 42, np.int32)), jnp.asarray(idx % num_slots, jnp.int32),
                jnp.asarray(context + idx // num_slots, jnp.int32), jnp.ones(T, bool))
        for mode in modes:
            max_per_slot = per_slot if mode == "grid" else None

            def step():
                logits, _, state["cache"] = forward_packed(model.weights, state["cache"], *args, model.cfg,
                                                           max_per_slot)
                return logits

            t = time_call(step, repeats=repeats, warmup=1)
            rows.append({"bench": "verify", "T": T, "mode": mode, "max_per_slot": max_per_slot,
                         "slots": num_slots, "context": context, "capacity": state["cache"].capacity,
                         "step_ms": 1e3 * t.median, "p25_ms": 1e3 * t.p25, "p75_ms": 1e3 * t.p75,
                         "tokens_per_s": T / t.median})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the floor table at 1 and 4 slots only, fewer repeats")
    p.add_argument("--json", type=writable_file, help="write the rows and the device description here (checked "
                                                       "before the benchmark, not after it)")
    add_model_arguments(p, draft=False)
    p.add_argument("--context", type=positive_int, default=256, help="committed tokens per slot")
    p.add_argument("--floor-only", action="store_true", help="only the table beside the weights-only floor")
    p.add_argument("--cache-dtype", choices=("float32", "bfloat16", "float16"),
                   help="the floor table's KV cache dtype (default: the weights')")
    args = p.parse_args(argv)

    model = load_target(args.model, dtype=args.dtype)
    repeats = 3 if args.quick else 7
    modes = ("grid",) if args.quick else ("per_token", "grid")
    floor = target_step_rows(model.weights, model.cfg, slots=(1, 4) if args.quick else (1, 4, 16, 64),
                             contexts=(256, 1024), per_slot=(1, 8), repeats=repeats, progress=print,
                             cache_dtype=None if args.cache_dtype is None else jnp.dtype(args.cache_dtype))
    print(format_table(floor, ["kind", "slots", "context", "per_slot", "tokens", "window", "step_ms", "floor_ms",
                               "ratio"]))
    decode = verify = []
    if not (args.floor_only or args.quick):
        decode = bench_decode(model, (1, 4, 16), args.context, repeats)
        verify = bench_verify(model, (8, 32, 128, 512), args.context, 16, repeats, modes)
        print()
        print(format_table(decode, ["slots", "context", "capacity", "step_ms", "tokens_per_s"]))
        print()
        print(format_table(verify, ["T", "mode", "slots", "context", "capacity", "step_ms", "tokens_per_s"]))
    if args.json:
        write_json(args.json, {"device": device_info(), "date": datetime.date.today().isoformat(),
                               "dtype": str(model.dtype), "cache_dtype": args.cache_dtype or str(model.dtype),
                               "quick": args.quick, "floor": floor, "decode": decode,
                               "verify": verify})


if __name__ == "__main__":
    main()
