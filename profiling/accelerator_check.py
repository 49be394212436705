"""The accelerator check, for the day a GPU or TPU is lent: random weights of a real model's shape in bf16,
decode and verification steps against the memory-bandwidth floor, the price of drafting rounds, compile count
and seconds, a quick SPS table; writes ``docs/benchmarks/<device>.md`` and a JSON beside it.

    python -m profiling.accelerator_check                                   # qwen3-8b + dspark-qwen3-8b, bf16
    python -m profiling.accelerator_check --dry-run --device-memory-gib 80 --gpu-memory-utilization 0.9 \
        --target-shape qwen3-8b --draft-shape dspark-qwen3-8b --json plan.json   # the memory plan, no device
    python -m profiling.accelerator_check --tiny --out /tmp/check            # the whole check on a CPU, tiny

Shapes: ``dspark_jax.models.presets`` (``--target-shape`` / ``--draft-shape``). The library side is
``dspark_jax.device_check``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax.numpy as jnp

from dspark_jax import device_check
from dspark_jax.build import parse_dtype
from dspark_jax.cli import fraction, positive_float, positive_int, writable_file
from dspark_jax.io import atomic_write_text
from dspark_jax.models.presets import DRAFT_SHAPES, TARGET_SHAPES, draft_shape, target_shape
from dspark_jax.timing import write_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-shape", default="qwen3-8b", choices=sorted(TARGET_SHAPES))
    p.add_argument("--draft-shape", default="dspark-qwen3-8b", choices=sorted(DRAFT_SHAPES))
    p.add_argument("--dtype", default="bfloat16", help="weights' and caches' dtype (default bfloat16)")
    p.add_argument("--dry-run", action="store_true", help="print (and with --json write) the memory plan only, "
                   "from shapes alone: no device is touched")
    p.add_argument("--device-memory-gib", type=positive_float, default=None,
                   help="the device memory to plan for (default: what the device reports; --dry-run needs it)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV page")
    p.add_argument("--max-model-len", type=positive_int, default=8192)
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    p.add_argument("--json", type=writable_file, default=None, help="where to write the result as JSON")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and small settings (CPU tests)")
    p.add_argument("--kv-layout", default="auto", choices=["auto", "pages", "slots"],
                   help="the caches the target's steps read (auto: the engine's choice for this device)")
    p.add_argument("--out", default="docs/benchmarks", help="folder of the report (<device>.md and .json)")
    args = p.parse_args(argv)
    if args.dry_run and args.device_memory_gib is None:
        p.error("--dry-run needs --device-memory-gib N (no device is asked)")
    if not Path(args.out).is_dir() and not args.dry_run:
        p.error(f"--out {args.out}: not a folder")
    return args


def device_slug(kind: str) -> str:
    """A file name for a device kind: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "device"


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = parse_dtype(args.dtype)
    if args.dry_run:
        plan = device_check.dry_run_plan(args.target_shape, args.draft_shape, device_memory_gib=args.device_memory_gib,
                                         gpu_memory_utilization=args.gpu_memory_utilization,
                                         block_size=args.block_size, max_model_len=args.max_model_len,
                                         max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens, dtype=dtype)
        print(f"{args.target_shape} + {args.draft_shape}:")
        print(plan.describe())
        if args.json:
            write_json(args.json, {"target_shape": args.target_shape, "draft_shape": args.draft_shape,
                                   **plan.to_dict()})
        return
    if args.tiny:
        target_cfg, draft_cfg, settings = device_check.TINY_TARGET, device_check.tiny_drafter_config(), device_check.TINY
        name, dtype = "tiny", jnp.float32 if args.dtype == "bfloat16" else dtype
    else:
        target_cfg, draft_cfg, settings = target_shape(args.target_shape), draft_shape(args.draft_shape), device_check.FULL
        name = f"{args.target_shape} + {args.draft_shape}"
    memory = None if args.device_memory_gib is None else int(args.device_memory_gib * device_check.GIB)
    result = device_check.run_check(target_cfg, draft_cfg, name=name, settings=settings, dtype=dtype,
                                    device_memory=memory, gpu_memory_utilization=args.gpu_memory_utilization,
                                    kv_layout=args.kv_layout)
    stem = Path(args.out) / (device_slug(result["device"]["device_kind"]) + ("-tiny" if args.tiny else ""))
    write_json(args.json or stem.with_suffix(".json"), result)
    atomic_write_text(stem.with_suffix(".md"), device_check.report_markdown(result))
    print(device_check.report_markdown(result))
    print(f"wrote {stem}.md and {args.json or stem.with_suffix('.json')}")


if __name__ == "__main__":
    main()
