"""A drafter folder: ``config.json`` + ``weights.npz`` (float16, or int8 with per-channel scales), written
atomically and loaded back into a `Drafter`. Inference reads drafters through this module; training writes them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.io import atomic_folder
from dspark_jax.models.drafter import Drafter, DrafterConfig

__all__ = ["INT8_MIN_SIZE", "SCALE_SUFFIX", "quantize_int8", "pack_weights", "flat_state", "save_drafter",
           "load_drafter"]

# Shipping format: config.json + weights.npz in one folder, written atomically. Floats are stored as float16;
# with ``quantize="int8"`` every weight matrix of at least ``INT8_MIN_SIZE`` entries is stored as int8 with one
# float32 scale per output channel (per row for embedding tables) under ``NAME@scale``, halving the file.
# Verification stays exact whatever the drafter's weights are; only its acceptance can change (docs/design.md,
# the drafters).

INT8_MIN_SIZE = 4096
SCALE_SUFFIX = "@scale"


def quantize_int8(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization of ``w`` with one scale per slice along ``axis`` (reduced over it).

    Returns ``(q, scale)`` with ``q * scale`` approximating ``w`` to within ``scale / 2`` per entry;
    ``scale`` keeps the reduced axis with size 1 so it broadcasts back.
    """
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def pack_weights(flat: dict[str, np.ndarray], dtype, quantize: str | None) -> dict[str, np.ndarray]:
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize={quantize!r}: expected None or 'int8'")
    out = {}
    for k, v in flat.items():
        if not np.issubdtype(v.dtype, np.floating):
            out[k] = v
        elif quantize == "int8" and v.ndim == 2 and v.size >= INT8_MIN_SIZE:
            # Kernels are [in, out]: one scale per output column. Embedding tables are [rows, dim]: per row.
            q, scale = quantize_int8(v, axis=1 if k.endswith("embedding") else 0)
            out[k], out[k + SCALE_SUFFIX] = q, scale
        else:
            out[k] = v.astype(dtype)
    return out


def flat_state(drafter: Drafter) -> dict[str, np.ndarray]:
    state = nnx.state(drafter)
    out = {}
    for path, var in nnx.to_flat_state(state):
        out["/".join(map(str, path))] = np.asarray(var[...] if hasattr(var, "__getitem__") else var.value)
    return out


def save_drafter(drafter: Drafter, path: str | os.PathLike, *, extra: dict[str, Any] | None = None,
                 dtype=np.float16, quantize: str | None = None,
                 attach: Sequence[str | os.PathLike] = ()) -> Path:
    """Write ``config.json`` and ``weights.npz`` (floats as ``dtype``, weight matrices as int8 with
    ``quantize="int8"``) to a folder, atomically, with copies of the ``attach`` files (STS temperatures,
    plots) under their own names."""
    path = Path(path)
    attach = [Path(f) for f in attach]
    for f in attach:
        if f.name in ("config.json", "weights.npz"):
            raise ValueError(f"attach: {f} would overwrite the drafter's own {f.name}")
    with atomic_folder(path) as tmp:
        flat = pack_weights(flat_state(drafter), dtype, quantize)
        np.savez(tmp / "weights.npz", **flat)
        meta = {"config": drafter.cfg.to_dict(), **(extra or {})}
        (tmp / "config.json").write_text(json.dumps(meta, indent=1) + "\n")
        for f in attach:
            shutil.copyfile(f, tmp / f.name)
    return path


def load_drafter(path: str | os.PathLike) -> tuple[Drafter, dict[str, Any]]:
    """Load a drafter folder written by `save_drafter` (weights as float32, int8 matrices dequantized).

    Returns (drafter, metadata)."""
    path = Path(path)
    cfg_path, w_path = path / "config.json", path / "weights.npz"
    if not cfg_path.is_file() or not w_path.is_file():
        raise ValueError(f"drafter {path}: expected config.json and weights.npz in the folder")
    meta = json.loads(cfg_path.read_text())
    cfg = DrafterConfig.from_dict(meta["config"])
    weights = dict(np.load(w_path))
    vocab_ids = weights.get("vocab_ids")
    drafter = Drafter(cfg, rngs=nnx.Rngs(0), vocab_ids=vocab_ids)
    state = nnx.state(drafter)
    flat = dict(nnx.to_flat_state(state))
    missing = [k for k in ("/".join(map(str, p)) for p in flat) if k not in weights]
    if missing:
        raise ValueError(f"drafter {path}: weights.npz lacks {missing[:5]} (config and weights disagree)")
    for p, var in flat.items():
        key = "/".join(map(str, p))
        arr, want = weights[key], var[...]
        if key + SCALE_SUFFIX in weights:
            arr = arr.astype(np.float32) * weights[key + SCALE_SUFFIX]
        elif arr.dtype == np.int8 and np.issubdtype(want.dtype, np.floating):
            raise ValueError(f"drafter {path}: {key} is stored as int8 without its {key}{SCALE_SUFFIX} entry")
        if arr.shape != want.shape:
            raise ValueError(f"drafter {path}: {key} has shape {arr.shape}, expected {want.shape}")
        var[...] = jnp.asarray(arr, want.dtype)
    return drafter, meta
