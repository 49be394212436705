"""The device mesh and the one table that lays the engine's arrays out on it.

Two named mesh axes, as serving users know them:

* ``data`` (``--data-parallel-size``): request slots are split across it (each group of devices holds the
  caches of its share of the slots); in training, the batch.
* ``tensor`` (``--tensor-parallel-size``): attention heads, FFN width and vocabulary are split across it.

Every array is declared once with the logical name of each of its axes (`Axes`); `RULES` maps logical
names to mesh axes, and `place` puts a pytree on the mesh with ``jax.device_put(x, NamedSharding(mesh,
P(...)))``. Jit then propagates the layout through the engine's programs, and XLA inserts the collectives:
this module writes no communication of its own.

A dimension that does not divide by its mesh axis is replicated (never padded): e.g. SmolLM2-135M's 9
query and 3 key/value heads replicate at ``tensor`` = 2 or 4 (its FFN width 1536 and vocabulary 49152 still
split), and 16 slots replicate at ``data`` = 3. `layout_report` says which arrays replicated what.

The paged KV layout's page pools (`paged_cache_axes`, `paged_drafter_cache_axes`) split over ``tensor`` on their
KV-head axis and are replicated over ``data``: every slot's reads of the pool are local to its own data group, and
one pool (one host `cache.pages.PagePool`, one prefix-cache index) serves the whole mesh; the block tables and
the per-slot arrays split over ``data`` with the slots.

Axis legend (logical names): layers, slots, heads (query heads, fused with the head dimension in the
weights), kv_heads, kv_pairs (a page pool's key-value pairs, one per KV head, interleaved on one axis), ffn,
vocab, embed (model width, never split), batch (training examples).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dspark_jax.cli import nonnegative_int, positive_int
from dspark_jax.models.drafter import DrafterCache, PagedDrafterCache
from dspark_jax.models.llama import KVCache, LayerWeights, LlamaConfig, LlamaWeights, PagedKVCache

__all__ = ["DATA", "TENSOR", "MESH_AXES", "ShardingRules", "RULES", "Axes", "make_mesh", "mesh_shape",
           "add_mesh_arguments", "initialize_distributed", "mesh_from_args", "mesh_of", "table_mesh",
           "check_table_mesh", "spec_for", "place", "target_axes", "kv_cache_axes", "drafter_cache_axes",
           "paged_cache_axes", "paged_drafter_cache_axes", "kv_pool_units", "drafter_state_axes", "target_units",
           "place_target_weights", "place_drafter_state", "layout_report", "to_host", "describe_mesh"]

DATA, TENSOR = "data", "tensor"
MESH_AXES = (DATA, TENSOR)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None: replicated). Logical names not listed here are replicated.

    >>> RULES.mesh_axis("heads"), RULES.mesh_axis("embed")
    ('tensor', None)
    """

    slots: str | None = DATA
    batch: str | None = DATA
    heads: str | None = TENSOR
    kv_heads: str | None = TENSOR
    kv_pairs: str | None = TENSOR
    ffn: str | None = TENSOR
    vocab: str | None = TENSOR

    def mesh_axis(self, logical: str | None) -> str | None:
        """The mesh axis a logical axis maps to, or None (replicated)."""
        return getattr(self, logical, None) if logical else None


RULES = ShardingRules()  # the one table: a change of parallelism touches this line only


@dataclasses.dataclass(frozen=True)
class Axes:
    """The logical names of an array's axes (None: an axis that never splits). A pytree leaf, so a tree of
    `Axes` mirrors the tree of arrays it describes.

    >>> Axes("layers", "embed", "heads").names
    ('layers', 'embed', 'heads')
    """

    names: tuple[str | None, ...]

    def __init__(self, *names: str | None):
        object.__setattr__(self, "names", tuple(names))


# ---------------------------------------------------------------------------------------------------- the mesh


def make_mesh(data: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``(data, tensor)`` mesh over ``data * tensor`` devices (default: all of ``jax.devices()``, every
    process's under ``jax.distributed``). Devices are laid out so that a ``tensor`` group is contiguous
    (neighbouring devices share the heavy per-layer collectives).

    Args:
      data: data-parallel size M (request slots; training batch).
      tensor: tensor-parallel size N (heads, FFN width, vocabulary).
      devices: the devices to use; their number must be M * N.
    Returns:
      a `jax.sharding.Mesh` with axes ("data", "tensor") of shape (M, N) and automatic axis types (jit
      propagates the layout).
    Raises:
      ValueError: a size below 1, or M * N different from the number of devices.

    >>> dict(make_mesh(1, 1, jax.devices()[:1]).shape)
    {'data': 1, 'tensor': 1}
    """
    data, tensor = int(data), int(tensor)
    if data < 1 or tensor < 1:
        raise ValueError(f"--data-parallel-size {data} and --tensor-parallel-size {tensor}: expected integers >= 1")
    devices = list(jax.devices() if devices is None else devices)
    if data * tensor != len(devices):
        raise ValueError(
            f"--data-parallel-size {data} x --tensor-parallel-size {tensor} = {data * tensor} devices, but "
            f"{len(devices)} are in use ({devices[0].platform}); the product must equal the device count "
            f"(on CPU, simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N set before "
            f"jax starts)")
    grid = np.asarray(devices, dtype=object).reshape(data, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_shape(mesh: Mesh | None) -> dict[str, int]:
    """``{"data": M, "tensor": N}`` of a mesh; ``{"data": 1, "tensor": 1}`` for None (one device).

    >>> mesh_shape(None)
    {'data': 1, 'tensor': 1}
    """
    if mesh is None:
        return {DATA: 1, TENSOR: 1}
    return {name: int(mesh.shape.get(name, 1)) for name in MESH_AXES}


def describe_mesh(mesh: Mesh | None) -> str:
    """``"2x4 (data x tensor)"``.

    >>> describe_mesh(None)
    '1x1 (data x tensor)'
    """
    s = mesh_shape(mesh)
    return f"{s[DATA]}x{s[TENSOR]} (data x tensor)"


def add_mesh_arguments(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``, ``--data-parallel-size`` and the ``jax.distributed`` options
    (``--coordinator-address``, ``--num-processes``, ``--process-id``) of every command that runs the engine."""
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="devices that split each layer's heads, FFN width and vocabulary (default 1)")
    p.add_argument("--data-parallel-size", type=positive_int, default=1,
                   help="device groups that split the request slots (default 1); the product of the two sizes "
                        "must equal the device count (every process's, under jax.distributed)")
    p.add_argument("--coordinator-address",
                   help="multi-process: HOST:PORT of process 0; every process runs the same command with its "
                        "--process-id (jax.distributed.initialize; omit on a TPU slice or under SLURM, where JAX "
                        "finds them itself when --num-processes is given)")
    p.add_argument("--num-processes", type=positive_int, help="multi-process: how many processes take part")
    p.add_argument("--process-id", type=nonnegative_int,
                   help="multi-process: this process's index, 0 .. num-processes - 1")


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Join a multi-process run (``jax.distributed.initialize``) unless there is none to join (every argument
    None and one process) or this process already joined. Call it before anything else touches JAX. On CPU,
    the processes' collectives run over gloo. Returns whether this process is part of a multi-process run."""
    if coordinator_address is None and num_processes in (None, 1):
        return False
    if not jax.distributed.is_initialized():
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id}: expected 0 <= id < --num-processes {num_processes}")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    return True


def mesh_from_args(args: Any) -> Mesh | None:
    """The mesh of ``--data-parallel-size`` / ``--tensor-parallel-size`` (`add_mesh_arguments`), joining the
    multi-process run first when asked to; None when both sizes are 1 in a single process (the single-device
    engine, unchanged). Call it before the model is loaded."""
    multi = initialize_distributed(getattr(args, "coordinator_address", None), getattr(args, "num_processes", None),
                                   getattr(args, "process_id", None))
    data = int(getattr(args, "data_parallel_size", 1) or 1)
    tensor = int(getattr(args, "tensor_parallel_size", 1) or 1)
    if data == 1 and tensor == 1 and not multi:
        return None
    return make_mesh(data=data, tensor=tensor)


def mesh_of(x: Any) -> Mesh | None:
    """The mesh an array lies on (a `NamedSharding`'s), or None (one device)."""
    sh = getattr(x, "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) else None


def table_mesh(table: Any) -> dict[str, int]:
    """The mesh an SPS table was measured on (``metadata.extra["mesh"]``; a table without one: 1x1).

    >>> from dspark_jax.sps import SPSMetadata, SPSTable
    >>> table_mesh(SPSTable.from_arrays([8, 16], [100.0, 90.0]))
    {'data': 1, 'tensor': 1}
    """
    rec = (table.metadata.extra or {}).get("mesh") or {}
    return {name: int(rec.get(name, 1)) for name in MESH_AXES}


def check_table_mesh(table: Any, mesh: Mesh | None, *, allow_mismatch: bool = False, source: str = "SPS table"
                     ) -> None:
    """Refuse (``ValueError``) a table measured on another mesh than the engine's: its steps/s are another
    machine's. ``allow_mismatch`` (``--allow-sps-mesh-mismatch``) turns the refusal into a warning."""
    have, want = table_mesh(table), mesh_shape(mesh)
    if have == want:
        return
    msg = (f"{source} was measured on a {have[DATA]}x{have[TENSOR]} mesh (data x tensor) but the engine runs on "
           f"{want[DATA]}x{want[TENSOR]}; profile one on this mesh (python -m profiling.profile_sps "
           f"--data-parallel-size {want[DATA]} --tensor-parallel-size {want[TENSOR]}) and pass it with --sps, or "
           f"pass --allow-sps-mesh-mismatch to use it anyway")
    if not allow_mismatch:
        raise ValueError(msg)
    warnings.warn(msg, stacklevel=2)


def mesh_fit(cfg: LlamaConfig, num_slots: int, mesh: Mesh | None) -> list[str]:
    """What the mesh cannot split for this target and slot count, in words (an empty list: everything it
    should): an axis whose size does not divide by its mesh axis is replicated (`spec_for`), so the devices
    of that axis repeat each other's work on it.

    >>> mesh_fit(LlamaConfig.tiny(), 3, make_mesh(1, 1))
    []
    """
    shape = mesh_shape(mesh)
    data, tensor = shape[DATA], shape[TENSOR]
    out = []
    if num_slots % data:
        out.append(f"{num_slots} slots do not divide by the {data} data-parallel groups: every group holds and "
                   f"decodes every slot (use a multiple of {data})")
    for what, n in (("attention heads", cfg.n_heads), ("KV heads", cfg.n_kv_heads), ("FFN width", cfg.ffn_dim),
                    ("vocabulary", cfg.vocab_size)):
        if n % tensor:
            out.append(f"the {n} {what} do not divide by the tensor-parallel size {tensor}: replicated on every "
                       f"tensor device")
    return out


# ---------------------------------------------------------------------------------------------------- layouts


def spec_for(shape: Sequence[int], axes: Axes, mesh: Mesh | Mapping[str, int], *,
             units: Mapping[str, int] | None = None, rules: ShardingRules = RULES) -> P:
    """The partition spec of one array: each logical axis mapped by the rules, replicated where its size
    (or its number of ``units``, e.g. heads for a fused heads x head-dim axis) does not divide by the mesh
    axis, or where an earlier axis of the array already took that mesh axis.

    Args:
      shape: the array's shape.
      axes: its logical axes (as many as the shape has dimensions).
      mesh: the mesh, or its axis sizes (``{"data": M, "tensor": N}``: a layout planned without devices).
      units: logical name -> how many indivisible units that axis holds (default: its size).
    Returns:
      a `PartitionSpec`.

    >>> m = make_mesh(1, 1, jax.devices()[:1])
    >>> spec_for((4, 6), Axes("slots", "heads"), m)
    P('data', 'tensor')
    >>> spec_for((4, 6), Axes("heads", None), make_mesh(1, 1, jax.devices()[:1]))
    P('tensor',)
    >>> spec_for((4, 6), Axes("slots", "heads"), {"data": 2, "tensor": 4})
    P('data',)
    """
    if len(axes.names) != len(shape):
        raise ValueError(f"logical axes {axes.names} do not match an array of shape {tuple(shape)}")
    units = units or {}
    sizes = mesh if isinstance(mesh, Mapping) else mesh.shape
    used, out = set(), []
    for size, name in zip(shape, axes.names):
        target = rules.mesh_axis(name)
        n = sizes.get(target, 1) if target is not None else 1
        count = units.get(name, size)
        if target is None or target in used or count % n or size % n:
            out.append(None)
        else:
            out.append(target)
            used.add(target)
    while out and out[-1] is None:  # the canonical form, as jit writes its output shardings
        out.pop()
    return P(*out)


def place(tree: Any, axes: Any, mesh: Mesh, *, units: Mapping[str, int] | None = None,
          rules: ShardingRules = RULES) -> Any:
    """Put every array of ``tree`` on the mesh by its logical axes (a tree of `Axes` of the same structure;
    a None leaf in ``tree`` stays None).

    Args:
      tree: a pytree of arrays.
      axes: the matching pytree of `Axes`.
      mesh: the mesh.
      units: see `spec_for`.
    Returns:
      the tree with each array a global array with ``NamedSharding(mesh, spec_for(...))``.
    """
    def put(ax, x):
        if x is None:
            return None
        return jax.device_put(x, NamedSharding(mesh, spec_for(np.shape(x), ax, mesh, units=units, rules=rules)))

    return jax.tree.map(put, axes, tree, is_leaf=lambda a: isinstance(a, Axes) or a is None)


def target_axes(weights: LlamaWeights) -> LlamaWeights:
    """Logical axes of the target's weights (`LlamaWeights`, one `LayerWeights` per layer)."""
    def layer(lw: LayerWeights) -> LayerWeights:
        opt = lambda a, ax: None if a is None else ax
        return LayerWeights(
            attn_norm=Axes("embed"), wq=Axes("embed", "heads"), wk=Axes("embed", "kv_heads"),
            wv=Axes("embed", "kv_heads"), wo=Axes("heads", "embed"), mlp_norm=Axes("embed"),
            w_gate=Axes("embed", "ffn"), w_up=Axes("embed", "ffn"), w_down=Axes("ffn", "embed"),
            q_norm=opt(lw.q_norm, Axes(None)), k_norm=opt(lw.k_norm, Axes(None)),
            bq=opt(lw.bq, Axes("heads")), bk=opt(lw.bk, Axes("kv_heads")), bv=opt(lw.bv, Axes("kv_heads")))

    return LlamaWeights(embed=Axes("vocab", "embed"), layers=tuple(layer(lw) for lw in weights.layers),
                        final_norm=Axes("embed"), lm_head=None if weights.lm_head is None else Axes("embed", "vocab"))


def kv_cache_axes(n_layers: int) -> KVCache:
    """Logical axes of the target's `KVCache` of ``n_layers`` layers (per layer k [S, K, E, C],
    v [S, K, C, E]; lengths [S])."""
    return KVCache(k=tuple(Axes("slots", "kv_heads", None, None) for _ in range(n_layers)),
                   v=tuple(Axes("slots", "kv_heads", None, None) for _ in range(n_layers)), lengths=Axes("slots"))


def drafter_cache_axes() -> DrafterCache:
    """Logical axes of the `DrafterCache` (k, v [L, S, C, K, E])."""
    return DrafterCache(k=Axes("layers", "slots", None, "kv_heads", None),
                        v=Axes("layers", "slots", None, "kv_heads", None))


def paged_cache_axes(n_layers: int) -> PagedKVCache:
    """Logical axes of the target's `PagedKVCache` of ``n_layers`` layers (per layer a page pool [P, ps, 2K, E],
    block tables [S, N], lengths [S]).

    The pool splits over ``tensor`` on its interleaved key-value axis (2K entries: place it with
    `kv_pool_units`, so that it splits in whole KV heads, as the slot caches do, or replicates) and is
    replicated over ``data``: its page axis never splits, so every slot's gathers of its pages stay on its own
    data group's devices (no communication on the read side, every layer of every round), a round's page writes
    are small scatters every data group applies, and one host `cache.pages.PagePool` (with one prefix-cache
    index) serves the whole mesh. The cost is memory: each data group holds the whole pool, so a pool is sized as
    for one tensor-parallel group (`cache.plan.plan_memory`). The block tables and lengths split over ``data``
    with the slots.

    >>> paged_cache_axes(1).pages[0].names, paged_cache_axes(1).block_tables.names
    ((None, None, 'kv_pairs', None), ('slots', None))
    """
    return PagedKVCache(pages=tuple(Axes(None, None, "kv_pairs", None) for _ in range(n_layers)),
                        block_tables=Axes("slots", None), lengths=Axes("slots"))


def paged_drafter_cache_axes() -> PagedDrafterCache:
    """Logical axes of the `PagedDrafterCache` (k, v [L, P, ps, K, E]): its pages follow the target's pool
    (`paged_cache_axes`), split over ``tensor`` on the drafter's KV heads and replicated over ``data``."""
    return PagedDrafterCache(k=Axes("layers", None, None, "kv_heads", None),
                             v=Axes("layers", None, None, "kv_heads", None))


def kv_pool_units(cfg: LlamaConfig) -> dict[str, int]:
    """Indivisible units of the target's page pool (`paged_cache_axes`): its 2K interleaved keys and values
    split in K whole KV heads (pass as ``units`` to `place`; no other array has a ``kv_pairs`` axis).

    >>> kv_pool_units(LlamaConfig.tiny())
    {'kv_pairs': 2}
    """
    return {"kv_pairs": int(cfg.n_kv_heads)}


def target_units(cfg: LlamaConfig) -> dict[str, int]:
    """Indivisible units of the target's (and a drafter's) fused axes: heads split whole.

    >>> target_units(LlamaConfig.tiny())
    {'heads': 4, 'kv_heads': 2}
    """
    return {"heads": int(cfg.n_heads), "kv_heads": int(cfg.n_kv_heads)}


# Drafter (Flax NNX) parameters by the end of their state path; anything else is replicated.
_DRAFTER_RULES = (
    (r"\.wq\.kernel$", Axes("embed", "heads")),
    (r"\.w[kv]\.kernel$", Axes("embed", "kv_heads")),
    (r"\.wo\.kernel$", Axes("heads", "embed")),
    (r"\.w_(gate|up)\.kernel$", Axes("embed", "ffn")),
    (r"\.w_down\.kernel$", Axes("ffn", "embed")),
    (r"^w2\.kernel$", Axes(None, "vocab")),
)


def _path_name(path) -> str:
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if name != "value":
            parts.append(str(name))
    return ".".join(parts)


def drafter_state_axes(state: Any) -> Any:
    """Logical axes of a drafter's NNX state (``nnx.split(drafter)[1]``), by parameter name."""
    def axes(path, x):
        name = _path_name(path)
        for pattern, ax in _DRAFTER_RULES:
            if re.search(pattern, name) and len(ax.names) == np.ndim(x):
                return ax
        return Axes(*([None] * np.ndim(x)))

    return jax.tree_util.tree_map_with_path(axes, state)


def place_target_weights(weights: LlamaWeights, cfg: LlamaConfig, mesh: Mesh) -> LlamaWeights:
    """The target's weights on the mesh (heads, FFN width and vocabulary split over ``tensor``)."""
    return place(weights, target_axes(weights), mesh, units=target_units(cfg))


def place_drafter_state(state: Any, cfg: Any, mesh: Mesh) -> Any:
    """A drafter's NNX state on the mesh (``cfg``: its `DrafterConfig`)."""
    units = {"heads": int(cfg.n_heads), "kv_heads": int(cfg.n_kv_heads)}
    return place(state, drafter_state_axes(state), mesh, units=units)


def layout_report(tree: Any) -> dict[str, str]:
    """Path -> partition spec of every sharded array of a tree (for docs and checks: what replicated)."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding):
            out[_path_name(path) or "."] = str(tuple(sh.spec))
    return out


def to_host(tree: Any) -> Any:
    """NumPy copies of a tree of arrays, also under ``jax.distributed`` where an array sharded across
    processes is not addressable here: such arrays are gathered from every process (a collective: every
    process must call this at the same point, as the engine's identical drivers do).

    >>> to_host({"a": jax.numpy.arange(3)})["a"].tolist()
    [0, 1, 2]
    """
    def remote(x):
        return isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)

    if not any(remote(x) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)  # one process (or replicated values): one batched copy

    def get(x):
        if remote(x):
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x) if isinstance(x, jax.Array) else x

    return jax.tree.map(get, tree)

