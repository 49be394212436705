"""The accelerator check: what the engine costs on a device, for a real model's shape with random weights.

`profiling.accelerator_check` runs it. Random weights of a named shape (`models.presets`) are built on the
device in the engine's dtype (no download: a step's cost does not depend on the values), and the check
measures, each in one process so that ratios hold:

* the memory plan (`cache.plan.plan_memory`) for the device's own memory, or for ``--device-memory-gib``;
* the device's copy bandwidth (a jitted ``x + 1`` over a large array: bytes read and written per second);
* decode and verification steps at 1-64 requests against two floors: the weights-only forward
  (`stages.target_step_rows`) and the memory-bandwidth floor, (weights + the K/V bytes the step must read)
  / the copy bandwidth;
* the price of drafting rounds against a plain one (`stages.round_stage_rows`, whole engine rounds);
* the compile count and seconds of everything above (jax's own compile events);
* a quick SPS table (`measure.profile_sps_table`, diagonal cells, one context).

``dry_run_plan`` touches no device: `jax.eval_shape` alone.

Axis legend: S requests (slots), L context tokens held per request, M tokens per request of a step.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.cache.plan import GIB, MemoryPlan, kv_bytes_per_token, plan_memory, target_bytes
from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
from dspark_jax.models.presets import draft_shape, target_shape
from dspark_jax.timing import compile_count, compile_seconds, device_info, time_call

__all__ = ["GIB", "CheckSettings", "TINY", "TINY_TARGET", "FULL", "tiny_drafter_config", "dry_run_plan", "device_memory_bytes", "random_target",
           "random_drafter_of", "copy_bandwidth", "run_check", "report_markdown"]


@dataclasses.dataclass(frozen=True)
class CheckSettings:
    """What the check measures: request counts, context, drafts, and the SPS table's reach."""

    slots: tuple[int, ...] = (1, 4, 16, 64)
    context: int = 1024
    round_users: tuple[int, ...] = (1, 16)
    round_context: int = 256
    drafts: tuple[int, ...] = (3, 7)
    sps_context: int = 512
    sps_max_tokens: int = 128
    copy_bytes: int = 1 << 30
    repeats: int = 5


FULL = CheckSettings()
TINY = CheckSettings(slots=(1, 2), context=128, round_users=(1,), round_context=32, drafts=(3,), sps_context=64,
                     sps_max_tokens=16, copy_bytes=1 << 22, repeats=2)
TINY_TARGET = LlamaConfig.tiny(n_layers=4, tap_layers=(0, 1, 2))


def tiny_drafter_config() -> DrafterConfig:
    """The ``--tiny`` check's drafter: one layer over the tiny target, block 4."""
    return DrafterConfig.for_target(TINY_TARGET, n_layers=1, block=4, rank=8, n_taps=3)


def dry_run_plan(target: str, draft: str | None, *, device_memory_gib: float, gpu_memory_utilization: float = 0.9,
                 block_size: int = 16, max_model_len: int = 8192, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, dtype: Any = jnp.bfloat16) -> MemoryPlan:
    """The memory plan of a named target (and drafter) shape on a device of ``device_memory_gib`` GiB, from
    shapes alone (nothing is allocated; runs anywhere).

    >>> plan = dry_run_plan("qwen3-8b", "dspark-qwen3-8b", device_memory_gib=80)
    >>> plan.kv_pool_tokens > 300_000
    True
    """
    if not device_memory_gib > 0:
        raise ValueError(f"device_memory_gib: expected a number > 0, got {device_memory_gib!r}")
    return plan_memory(target_shape(target), None if draft is None else draft_shape(draft),
                       device_memory_bytes=int(device_memory_gib * GIB), gpu_memory_utilization=gpu_memory_utilization,
                       block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, dtype=dtype)


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """The device's memory as its runtime reports it (``bytes_limit``), None where it does not (a CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 (backends without memory stats raise various errors)
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def random_target(cfg: LlamaConfig, dtype: Any = jnp.bfloat16, seed: int = 0) -> LlamaModel:
    """A target of ``cfg``'s shape with random weights, generated on the default device in ``dtype``."""
    build = jax.jit(init_random_weights, static_argnums=(0, 2))
    return LlamaModel(cfg, build(cfg, jax.random.key(seed), dtype), None)


def random_drafter_of(cfg: DrafterConfig, seed: int = 0) -> Drafter:
    """A drafter of ``cfg``'s shape with random weights (its parameters in float32, as trained ones load)."""
    return Drafter(cfg, rngs=nnx.Rngs(seed), vocab_ids=np.arange(cfg.draft_vocab, dtype=np.int32))


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second the device reads plus writes in a jitted elementwise pass over ``nbytes``."""
    n = max(1, nbytes // 4)
    x = jnp.ones((n,), jnp.float32)
    step = jax.jit(lambda a: a + 1.0)
    t = time_call(lambda: step(x), repeats=repeats, warmup=2)
    return 2 * n * 4 / t.median


def run_check(target_cfg: LlamaConfig, draft_cfg: DrafterConfig, *, name: str, settings: CheckSettings = FULL,
              dtype: Any = jnp.bfloat16, device_memory: int | None = None, gpu_memory_utilization: float = 0.9,
              kv_layout: str = "auto", progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run every measurement of the check on the default device; returns a JSON-ready dict.

    Args:
      target_cfg, draft_cfg: the shapes; ``name``: their label in the report.
      settings: what to measure (`FULL` on an accelerator, `TINY` for a CPU test).
      dtype: weights' dtype; device_memory: bytes for the plan (default: the device's own, else none planned).
      kv_layout: the caches the target's steps read ("auto": what an engine picks on this device, pages on one
        GPU or TPU, dense slots on a CPU).
    """
    from dspark_jax import measure, stages  # noqa: PLC0415 (measure imports the engine's building blocks)

    from dspark_jax.engine import EngineConfig  # noqa: PLC0415

    say = progress or (lambda _: None)
    layout = EngineConfig(kv_layout=kv_layout).layout_for(jax.devices()[0].platform, 1)
    started, c0, s0 = time.perf_counter(), compile_count(), compile_seconds()
    out: dict[str, Any] = {"name": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "device": device_info(), "dtype": jnp.dtype(dtype).name,
                           "settings": dataclasses.asdict(settings), "kv_layout": layout}
    memory = device_memory if device_memory is not None else device_memory_bytes()
    if memory is not None:
        try:
            out["plan"] = plan_memory(target_cfg, draft_cfg, device_memory_bytes=memory,
                                      gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                                      max_model_len=min(8192, settings.context * 8)).to_dict()
        except ValueError as err:
            out["plan"] = {"error": str(err)}
    say("building random weights on the device")
    target = random_target(target_cfg, dtype)
    drafter = random_drafter_of(draft_cfg)
    say("copy bandwidth")
    bw = copy_bandwidth(settings.copy_bytes)
    out["copy_bandwidth_gb_s"] = bw / 1e9
    weights, kv_tok = target_bytes(target_cfg, dtype), kv_bytes_per_token(target_cfg, None, dtype)
    rows = stages.target_step_rows(target.weights, target_cfg, slots=settings.slots, contexts=(settings.context,),
                                   per_slot=(1, draft_cfg.block + 1), repeats=settings.repeats, progress=say,
                                   kv_layout=layout)
    for r in rows:  # what the step must read at least: every weight once, every held K/V once
        floor_s = (weights + r["slots"] * (r["context"] + r["per_slot"]) * kv_tok) / bw
        r["bandwidth_floor_ms"] = 1e3 * floor_s
        r["of_bandwidth_floor"] = r["step_ms"] / r["bandwidth_floor_ms"]
    out["target_steps"] = rows
    stage_rows = stages.round_stage_rows(target, drafter, users=settings.round_users, context=settings.round_context,
                                         drafts=settings.drafts, verify_tokens=(1, draft_cfg.block + 1),
                                         repeats=settings.repeats, progress=say)
    out["round_prices"] = [{"users": r["users"], "round": r["stage"], "ms": r["ms"],
                            "of_plain_round": r["of_plain_round"]}
                           for r in stage_rows if r["stage"].startswith("round ")]
    out["round_stages"] = stage_rows
    say("quick SPS table")
    table = measure.profile_sps_table(target.weights, target_cfg, model=name, context_lengths=(settings.sps_context,),
                                      max_tokens=settings.sps_max_tokens, drafter=drafter, block=draft_cfg.block,
                                      diagonal=True, repeats=settings.repeats, round_overhead=False, host_speed=False)
    out["sps_table"] = table.to_json()
    out["compiles"] = compile_count() - c0
    out["compile_seconds"] = compile_seconds() - s0
    out["seconds"] = time.perf_counter() - started
    return out


def report_markdown(result: dict[str, Any]) -> str:
    """The check's result as a dated benchmark document."""
    dev = result["device"]
    lines = [f"# Accelerator check: {dev['device_kind']} ({dev['backend']})", "",
             f"`python -m profiling.accelerator_check` on {result['date']}: {result['name']}, random weights in "
             f"{result['dtype']}, {result['kv_layout']} KV caches, jax {dev['jax_version']}, {dev['device_count']} "
             f"device(s), host {dev['host']}. "
             f"{result['seconds']:.0f} s in all; {result['compiles']} compilations taking "
             f"{result['compile_seconds']:.1f} s.", ""]
    if "plan" in result:
        p = result["plan"]
        lines += ["## Memory plan", ""]
        lines += ([f"Not planned: {p['error']}"] if "error" in p else [
            f"{p['device_memory_bytes'] / GIB:.1f} GiB x {p['gpu_memory_utilization']}: weights "
            f"{p['weights_bytes'] / GIB:.2f} GiB, drafter {p['drafter_bytes'] / GIB:.2f} GiB, workspace "
            f"{p['workspace_bytes'] / GIB:.2f} GiB, KV pool {p['kv_pool_tokens']} tokens "
            f"({p['kv_bytes_per_token']} bytes/token)."])
        lines.append("")
    lines += [f"Copy bandwidth: {result['copy_bandwidth_gb_s']:.1f} GB/s (read + write).", "",
              "## Target steps against the floors", "",
              "| kind | requests | context | tokens | step ms | weights-only floor ms | x | bandwidth floor ms | x |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["target_steps"]:
        lines.append(f"| {r['kind']} | {r['slots']} | {r['context']} | {r['tokens']} | {r['step_ms']:.2f} | "
                     f"{r['floor_ms']:.2f} | {r['ratio']:.2f} | {r['bandwidth_floor_ms']:.2f} | "
                     f"{r['of_bandwidth_floor']:.2f} |")
    lines += ["", "## Drafting rounds against a plain round", "", "| users | round | ms | x plain |",
              "| ---: | --- | ---: | ---: |"]
    for r in result["round_prices"]:
        lines.append(f"| {r['users']} | {r['round']} | {r['ms']:.2f} | {r['of_plain_round']:.2f} |")
    pts = result["sps_table"].get("points", [])
    lines += ["", "## Quick SPS table", "", "| batch tokens | steps/s |", "| ---: | ---: |"]
    lines += [f"| {p['batch_tokens']} | {p['steps_per_s']:.1f} |" for p in pts]
    return "\n".join(lines) + "\n"
