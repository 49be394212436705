"""Finding a drafter: the shipped ones by name (``dspark``, ``dflash``) or a folder written by
`training.save_drafter`, with its STS temperatures (``sts.json`` beside the weights) when present."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import numpy as np

from dspark_jax.calibration import load_temperatures
from dspark_jax.models.drafter import Drafter
from dspark_jax.training import load_drafter

SHIPPED = ("dspark", "dflash")


def shipped_dir(name: str) -> Path:
    return Path(str(importlib.resources.files("dspark_jax"))) / "assets" / "drafters" / name


def resolve_drafter(spec: str | None = None, *, target_cfg=None) -> tuple[Drafter, dict, np.ndarray | None, Path]:
    """Load a drafter by shipped name or path. Returns (drafter, metadata, STS temperatures or None, folder).

    Args:
      spec: ``"dspark"`` (default), ``"dflash"`` or a folder path.
      target_cfg: the target's LlamaConfig, to check that the drafter was built for it.
    """
    spec = spec or "dspark"
    path = shipped_dir(spec) if spec in SHIPPED else Path(spec)
    if not (path / "config.json").is_file():
        if spec in SHIPPED:
            raise ValueError(f"the shipped drafter {spec!r} is missing from this installation ({path}); "
                             f"train one (README, 'Training the drafters') or pass --draft PATH")
        raise ValueError(f"--draft {spec}: expected a drafter folder with config.json and weights.npz, "
                         f"or one of {SHIPPED}")
    drafter, meta = load_drafter(path)
    if target_cfg is not None:
        c = drafter.cfg
        want = (target_cfg.vocab_size, target_cfg.dim, len(target_cfg.tap_layers))
        have = (c.vocab_size, c.dim, c.n_taps)
        if want != have:
            raise ValueError(f"drafter {path} was built for a target with (vocab, width, taps) = {have}, "
                             f"but the target has {want}")
    sts = path / "sts.json"
    temps = load_temperatures(sts) if sts.is_file() else None
    return drafter, meta, temps, path
