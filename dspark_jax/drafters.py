"""Finding a drafter: the shipped ones by name (``dspark``, ``dflash``) or a folder written by
`training.save_drafter`, with its STS temperatures (``sts.json`` beside the weights) when present."""

from __future__ import annotations

import importlib.resources
import json
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


def prior_confidence(path: Path, default: float) -> float:
    """The engine's starting confidence per position for this drafter: the first draft's observed acceptance
    on the rounds its STS temperatures were fitted on (``calibration.json`` beside the weights, written by
    ``train.calibrate``), else ``default``. A fresh engine's gate then starts from what the drafter achieved
    on held-out prompts instead of a guess (0.7 per position expected ~1.9 accepted drafts of a block where
    the shipped drafter accepts ~0.5)."""
    report = Path(path) / "calibration.json"
    if not report.is_file():
        return default
    try:
        value = float(json.loads(report.read_text())["per_position"][0]["conditional"])
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise ValueError(f"{report}: expected per_position[0].conditional, a number in (0, 1]") from err
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{report}: per_position[0].conditional = {value}, expected a number in (0, 1]")
    return value
