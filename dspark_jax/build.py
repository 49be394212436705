"""The one way to build an engine: names or paths -> target, drafter, SPS table, `Engine`.

Every command that runs the engine (`generate`, `demo`, the benchmarks, the server) and the tests build it here,
so an option such as ``--model``, ``--draft`` or ``--dtype`` means the same everywhere:

    target = load_target("path/to/model.gguf")                  # or a Hugging Face folder, or None (default)
    engine = build_engine(target, policy="dspark", draft="dspark", num_slots=8,
                          max_prompt_tokens=256, max_new_tokens=128)

Command-line scripts add the shared options with `add_model_arguments` / `add_engine_arguments` and call
`engine_from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.calibration import STSSets
from dspark_jax.cli import fraction, model_path, nonnegative_int, positive_int, temperature
from dspark_jax.drafters import prior_confidence, resolve_drafter, tapped_for
from dspark_jax.engine import Engine, EngineConfig, parse_policy
from dspark_jax.models.drafter import Drafter
from dspark_jax.models.llama import LlamaModel

__all__ = ["DTYPES", "parse_dtype", "load_target", "LoadedDrafter", "load_drafter_for", "tapped_for", "target_name",
           "sps_table_for", "cache_capacity", "build_engine", "add_model_arguments", "add_engine_arguments",
           "engine_from_args"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(name: str | None, backend: str | None = None) -> Any:
    """A weight dtype by name: ``float32``, ``bfloat16``, ``float16``, or ``auto``/None (bfloat16 on an
    accelerator, float32 on CPU, where XLA's bfloat16 matrix products are slower than float32's), for
    ``backend`` (default: JAX's default backend).

    >>> parse_dtype("bfloat16"), parse_dtype("auto", backend="cpu")
    (<class 'jax.numpy.bfloat16'>, <class 'jax.numpy.float32'>)
    """
    if name in (None, "auto"):
        return jnp.float32 if (backend or jax.default_backend()) == "cpu" else jnp.bfloat16
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"--dtype {name!r}: expected one of auto, {', '.join(DTYPES)}") from None


def target_name(model: str | Path | None) -> str:
    """The name an SPS table records for a target: the GGUF file name or the Hugging Face folder name."""
    from dspark_jax.models.gguf import MODEL_FILE  # noqa: PLC0415

    return MODEL_FILE if model is None else Path(model).name


def load_target(model: str | Path | None = None, *, dtype: Any = None, mesh: Any = None) -> LlamaModel:
    """Load a target model: None (the embedded default, SmolLM2-135M-Instruct's GGUF, fetched once), a GGUF
    file, or a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors`` + ``tokenizer.json``).

    Args:
      model: the path, or None.
      dtype: a dtype or its name (`parse_dtype`); None: ``auto``.
      mesh: optional device mesh (`sharding.make_mesh`): the weights are laid out on it (`sharding.RULES`).
    Raises:
      ValueError: naming the path and what was expected, before any weight is read.

    >>> load_target("no/such/model.gguf")
    Traceback (most recent call last):
    ...
    ValueError: --model no/such/model.gguf: no such file or folder (expected a GGUF file or a Hugging Face checkpoint folder)
    """
    if mesh is not None:
        from dspark_jax.sharding import place_target_weights  # noqa: PLC0415

        # Read and cast in host memory (JAX's CPU device), then put each device's shards on it: a model larger
        # than one accelerator's memory never lands whole on its first device.
        with jax.default_device(_host_device()):
            loaded = load_target(model, dtype=dtype)
        return LlamaModel(loaded.cfg, place_target_weights(loaded.weights, loaded.cfg, mesh), loaded.tokenizer)
    dtype = parse_dtype(dtype) if dtype is None or isinstance(dtype, str) else dtype
    if model is None:
        return LlamaModel.from_gguf(None, dtype=dtype)
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {path}: a folder must be a Hugging Face checkpoint with config.json, "
                             f"*.safetensors and tokenizer.json; config.json is missing")
        from dspark_jax.models import hf  # noqa: PLC0415

        return hf.load_hf_model(path, dtype=dtype)
    if not path.is_file():
        raise ValueError(f"--model {path}: no such file or folder (expected a GGUF file or a Hugging Face "
                         f"checkpoint folder)")
    return LlamaModel.from_gguf(path, dtype=dtype)


def _host_device() -> Any:
    """JAX's CPU device (host memory), or the default device where the CPU backend is not loaded
    (``JAX_PLATFORMS`` without ``cpu``)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


@dataclasses.dataclass
class LoadedDrafter:
    """A drafter with what the engine needs beside it."""

    drafter: Drafter
    sts_temperatures: STSSets | np.ndarray | None  # sets by sampling temperature, one set [G], or None
    prior_confidence: float  # the first draft's acceptance on its calibration rounds (the gate's start)
    path: Path | None  # the folder it was loaded from (None: built in memory)


def load_drafter_for(target: LlamaModel, draft: str | Path | None = "dspark") -> LoadedDrafter:
    """A drafter by shipped name (``dspark``, ``dflash``), our folder or a DeepSpec checkpoint folder, checked
    against the target (a DeepSpec drafter's parameters take the target's dtype).

    Raises:
      ValueError: naming the folder and what was expected (a drafter folder, or one built for this target).

    >>> from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
    >>> tiny = LlamaModel(LlamaConfig.tiny(), init_random_weights(LlamaConfig.tiny(), jax.random.key(0)))
    >>> load_drafter_for(tiny, "dspark")
    Traceback (most recent call last):
    ...
    ValueError: .../dspark/config.json: vocab_size = 49152, but the target's vocabulary has 64 tokens
    """
    drafter, _, temps, path = resolve_drafter(None if draft is None else str(draft), target_cfg=target.cfg,
                                              dtype=target.dtype)
    return LoadedDrafter(drafter, temps, prior_confidence(path, EngineConfig.prior_confidence), path)


def sps_table_for(model_name: str, block: int, path: str | Path | None = None):
    """The SPS table for a target and block: the file at ``path``, else the packaged table chosen for this host,
    warned about where it was measured for another model or block. The engine it is given to checks the rest
    (mesh, backend, device kind, dtype, drafter, reach)."""
    from dspark_jax.sps import default_sps_table, load_sps_table  # noqa: PLC0415

    if path is not None:
        return load_sps_table(path, model=model_name, block=block)
    return default_sps_table(model=model_name)


def cache_capacity(max_prompt_tokens: int, max_new_tokens: int, block: int, step: int = 128) -> int:
    """Cache positions per slot for a prompt, its answer and one verification block, rounded up to `step`.

    >>> cache_capacity(256, 128, 7)
    512
    """
    return -(-(int(max_prompt_tokens) + int(max_new_tokens) + int(block) + 1) // step) * step


def build_engine(target: LlamaModel, policy: str = "dspark", *, draft: str | Path | LoadedDrafter | None = "dspark",
                 sps: Any = None, num_slots: int = 16, max_prompt_tokens: int = 256, max_new_tokens: int = 256,
                 capacity: int | None = None, temperature: float = 0.0, seed: int = 0,
                 model_name: str | None = None, mesh: Any = None, allow_sps_mesh_mismatch: bool = False,
                 gpu_memory_utilization: float = 0.9, **config: Any) -> Engine:
    """An engine for a loaded target.

    Args:
      target: the target (`load_target`).
      policy: ``none``, ``fixed:K``, ``threshold:C``, ``dspark`` or ``dspark-async``.
      draft: a shipped drafter name, a folder, or a `LoadedDrafter` (ignored by ``none``).
      sps: for the dspark policies, an `SPSTable`, a path to one, or None (the packaged table for this host).
      num_slots: requests decoded together.
      max_prompt_tokens, max_new_tokens: size the cache (unless `capacity` is given).
      temperature, seed: sampling (0: greedy).
      model_name: the name SPS tables record for the target (default: SmolLM2's GGUF file name).
      mesh: optional ``(data, tensor)`` device mesh (`sharding.make_mesh`) the engine runs on.
      allow_sps_mesh_mismatch: use an SPS table measured on another mesh (otherwise refused).
      gpu_memory_utilization: with the "pages" KV layout on a device that reports its memory (a GPU, a TPU) and
        no ``num_pages``, the share of that memory for weights, drafter, a round's workspace and the page pool,
        which gets the rest (`cache.plan.plan_memory`, per device of a tensor-parallel group on a mesh; at most
        every slot at full capacity).
      **config: any other `EngineConfig` field (``kv_layout``, ``block_size``, ``num_pages``,
        ``max_num_batched_tokens``, ``gate``: a `gate.GateConfig`, ...).

    With a target and a drafter of one's own (here tiny and random), speculative decoding gives exactly the
    plain greedy output:

    >>> from flax import nnx
    >>> from dspark_jax.models.drafter import Drafter, DrafterConfig
    >>> from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
    >>> cfg = LlamaConfig.tiny()
    >>> target = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0)))
    >>> drafter = Drafter(DrafterConfig.for_target(cfg, n_layers=1, ffn_dim=64, rank=8, block=3), rngs=nnx.Rngs(0))
    >>> own = LoadedDrafter(drafter, sts_temperatures=None, prior_confidence=0.5, path=None)
    >>> prompts = [[1, 2, 3], [4, 5]]
    >>> plain = build_engine(target, "none", num_slots=2, max_prompt_tokens=8, max_new_tokens=6).run(prompts, 6)
    >>> spec = build_engine(target, "fixed:3", draft=own, num_slots=2, max_prompt_tokens=8, max_new_tokens=6)
    >>> [c.output_ids for c in spec.run(prompts, 6)] == [c.output_ids for c in plain]
    True
    """
    pol = parse_policy(policy)
    loaded = None
    if pol.drafts:
        loaded = draft if isinstance(draft, LoadedDrafter) else load_drafter_for(target, draft)
    block = loaded.drafter.cfg.block if loaded is not None else 1
    table = None
    if pol.kind in ("dspark", "dspark-async"):
        from dspark_jax.sps import SPSTable  # noqa: PLC0415

        name = model_name or target_name(None)
        table = sps if isinstance(sps, SPSTable) else sps_table_for(name, block, sps)
    if capacity is None:
        capacity = cache_capacity(max_prompt_tokens, max_new_tokens, block)
    if loaded is not None:
        config.setdefault("prior_confidence", loaded.prior_confidence)
        target = tapped_for(target, loaded.drafter)
    cfg = EngineConfig(num_slots=int(num_slots), capacity=int(capacity), temperature=float(temperature),
                       seed=int(seed), **config)
    if cfg.num_pages is None:
        pages = planned_pages(target, loaded.drafter.cfg if loaded is not None else None, cfg, mesh,
                              gpu_memory_utilization)
        if pages is not None:
            cfg = dataclasses.replace(cfg, num_pages=pages)
    return Engine(target, loaded.drafter if loaded is not None else None, pol, cfg,
                  sts_temperatures=loaded.sts_temperatures if loaded is not None else None, sps=table, mesh=mesh,
                  allow_sps_mesh_mismatch=allow_sps_mesh_mismatch)


def planned_pages(target: LlamaModel, drafter_cfg: Any, cfg: EngineConfig, mesh: Any,
                  gpu_memory_utilization: float) -> int | None:
    """Pages for a "pages" engine on a device that reports its memory: what `cache.plan.plan_memory` leaves
    for the pool at ``gpu_memory_utilization``, at most every slot at full capacity; None elsewhere (the engine's
    default: every slot at full capacity). On a mesh, planned per device of a tensor-parallel group: the pool
    splits over ``tensor`` and is replicated over ``data`` (`sharding.paged_cache_axes`)."""
    from dspark_jax.cache.pages import pages_for  # noqa: PLC0415
    from dspark_jax.cache.plan import plan_memory  # noqa: PLC0415
    from dspark_jax.device_check import device_memory_bytes  # noqa: PLC0415
    from dspark_jax.sharding import TENSOR, mesh_shape  # noqa: PLC0415

    device = mesh.devices.flat[0] if mesh is not None else next(iter(target.weights.embed.devices()))
    if cfg.layout_for(device.platform, 1 if mesh is None else mesh.devices.size) != "pages":
        return None
    memory = device_memory_bytes(device)
    if memory is None:
        return None
    plan = plan_memory(target.cfg, drafter_cfg, device_memory_bytes=memory,
                       gpu_memory_utilization=gpu_memory_utilization, block_size=cfg.block_size,
                       max_model_len=cfg.capacity, max_num_seqs=cfg.num_slots,
                       max_num_batched_tokens=cfg.max_num_batched_tokens or cfg.capacity, dtype=target.dtype,
                       tensor_parallel_size=mesh_shape(mesh)[TENSOR])
    return min(plan.kv_pool_pages, cfg.num_slots * pages_for(cfg.capacity, cfg.block_size))


def add_model_arguments(p: argparse.ArgumentParser, *, draft: bool = True) -> None:
    """``--model``, ``--dtype`` (and ``--draft``), and the device mesh (`sharding.add_mesh_arguments`:
    ``--tensor-parallel-size``, ``--data-parallel-size``, multi-process options): the options of every command
    that loads a model. Call `sharding.mesh_from_args` before loading it."""
    from dspark_jax.sharding import add_mesh_arguments  # noqa: PLC0415

    add_mesh_arguments(p)
    p.add_argument("--model", type=model_path, help="a GGUF file or a Hugging Face checkpoint folder (default: the "
                                                     "embedded SmolLM2-135M-Instruct GGUF, fetched once)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights: auto (bfloat16 on an accelerator, float32 on CPU), " f"{', '.join(DTYPES)}")
    if draft:
        p.add_argument("--draft", default="dspark", help="dspark | dflash | a drafter folder (ours, or a DeepSpec "
                                                         "DFlash/DSpark checkpoint)")


def add_engine_arguments(p: argparse.ArgumentParser, *, policy: str = "dspark") -> None:
    """The model options plus ``--policy``, ``--sps``, ``--temperature``, ``--seed``."""
    add_model_arguments(p)
    p.add_argument("--policy", default=policy, help="none | fixed:K | threshold:C | dspark | dspark-async")
    p.add_argument("--sps", help="SPS table JSON (default: the packaged table chosen for this host)")
    p.add_argument("--allow-sps-mesh-mismatch", action="store_true",
                   help="use an SPS table measured on another mesh than --data/--tensor-parallel-size's")
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 means greedy")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    g = p.add_argument_group("KV cache and scheduling (vLLM's names)")
    g.add_argument("--kv-layout", default="auto", choices=["auto", "pages", "slots"],
                   help="auto: a page pool on a GPU/TPU (ragged paged attention kernels; on a mesh split over "
                        "tensor and replicated over data), dense per-slot caches on a CPU")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV page")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="share of the device's memory for weights, drafter, workspace and the page pool (pages layout)")
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None,
                   help="pages in the pool, instead of what --gpu-memory-utilization leaves")
    g.add_argument("--max-num-batched-tokens", type=nonnegative_int, default=512,
                   help="tokens a step may run: running requests first, prompts prefilled in chunks in the rest "
                        "(0: each prompt whole at admission)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="keep full pages of finished and running requests (target K/V and the drafter's context) for "
                        "later requests whose prompts start the same (default: on wherever it runs; the slot "
                        "layout on a device mesh runs without it)")
    g.add_argument("--num-prefix-pages", type=positive_int, default=None,
                   help="pages of the prefix store of the slot layout (default: half the slots' pages); the pages "
                        "layout keeps prefixes in its pool")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="positions one request may hold (prompt, answer and one block); default: from the prompt "
                        "and answer limits")


def engine_from_args(args: argparse.Namespace, target: LlamaModel, *, num_slots: int, max_prompt_tokens: int,
                     max_new_tokens: int, mesh: Any = None, **config: Any) -> Engine:
    """`build_engine` with the options `add_engine_arguments` declared (``mesh``: default
    `sharding.mesh_from_args`)."""
    if mesh is None:
        from dspark_jax.sharding import mesh_from_args  # noqa: PLC0415

        mesh = mesh_from_args(args)
    config = {"kv_layout": args.kv_layout, "block_size": args.block_size, "num_pages": args.num_gpu_blocks_override,
              "max_num_batched_tokens": args.max_num_batched_tokens or None,
              "enable_prefix_caching": getattr(args, "enable_prefix_caching", None),
              "num_prefix_pages": getattr(args, "num_prefix_pages", None), **config}
    return build_engine(target, args.policy, draft=args.draft, sps=args.sps, num_slots=num_slots,
                        max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                        capacity=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                        temperature=args.temperature, seed=args.seed, model_name=target_name(args.model), mesh=mesh,
                        allow_sps_mesh_mismatch=getattr(args, "allow_sps_mesh_mismatch", False), **config)
