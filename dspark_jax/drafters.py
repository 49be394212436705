"""Finding a drafter: the shipped ones by name (``dspark``, ``dflash``) or a folder written by
`training.save_drafter`, with its STS temperatures (``sts.json`` beside the weights) when present."""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

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


def installed_package_path(path: str | Path) -> bool:
    """Whether ``path`` lies inside the installed package (its assets included) or any ``site-packages`` /
    ``dist-packages`` folder: places commands must never write into.

    >>> installed_package_path(shipped_dir("dspark")), installed_package_path("runs/dspark")
    (True, False)
    """
    p = Path(path).absolute().resolve()
    package = Path(str(importlib.resources.files("dspark_jax"))).absolute().resolve()
    return p == package or package in p.parents or any(part in ("site-packages", "dist-packages")
                                                       for part in p.parts)


def copy_drafter(source: str | Path, out: str | Path, *, attach: Sequence[str | Path] = ()) -> Path:
    """Copy the files of a drafter folder to ``out``, with the ``attach`` files added under their own names
    (replacing the source's files of those names, e.g. ``sts.json``), atomically: the folder is assembled
    beside ``out`` and renamed into place, so ``out`` is either the old folder or the complete new one.

    Args:
      source: a drafter folder (any format `resolve_drafter` loads; its top-level files are copied).
      out: the new folder. An existing ``out`` is replaced only if it is empty or holds a drafter
        (``config.json``), never when it is ``source`` itself.
      attach: files to add.
    Returns:
      ``out``.
    """
    source, out = Path(source), Path(out)
    if out.absolute().resolve() == source.absolute().resolve():
        raise ValueError(f"copy_drafter: {out} is the source folder itself")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file())):
        raise ValueError(f"{out} exists and is not a drafter folder (no config.json); choose a new folder")
    attach = [Path(f) for f in attach]
    names = {f.name for f in attach}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in names:
                shutil.copyfile(f, tmp / f.name)
        for f in attach:
            shutil.copyfile(f, tmp / f.name)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.rmdir(old)
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
