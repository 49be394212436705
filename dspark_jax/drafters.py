"""Finding a drafter: the shipped ones by name (``dspark``, ``dflash``), a folder written by
`models.drafter_files.save_drafter` (with its STS temperatures, ``sts.json`` beside the weights, when present), a
DeepSpec DFlash/DSpark checkpoint folder (`dspark_jax.models.deepspec`) or a vLLM speculators DSpark/DFlash folder
(`dspark_jax.models.speculators`)."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import shutil
import types
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp

from dspark_jax.calibration import STSSets, load_sts
from dspark_jax.io import atomic_folder
from dspark_jax.models.deepspec import (check_drafter_fits, deepspec_drafter_config, is_deepspec_folder,
                                        load_deepspec_drafter)
from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.models.llama import default_tap_layers
from dspark_jax.models.drafter_files import load_drafter
from dspark_jax.models.speculators import (load_speculators_drafter, speculators_drafter_config,
                                           speculators_model_type)

SHIPPED = ("dspark", "dflash")


def shipped_dir(name: str) -> Path:
    return Path(str(importlib.resources.files("dspark_jax"))) / "assets" / "drafters" / name


def drafter_format(path: str | Path) -> str | None:
    """``"dspark-jax"`` (a `models.drafter_files.save_drafter` folder), ``"deepspec"`` (a DeepSpec checkpoint),
    ``"speculators"`` (a config with ``speculators_model_type``: its loader refuses the types it does not read, by
    name) or None."""
    path = Path(path)
    if speculators_model_type(path) is not None:
        return "speculators"
    if is_deepspec_folder(path):
        return "deepspec"
    if (path / "config.json").is_file() and (path / "weights.npz").is_file():
        return "dspark-jax"
    return None


def resolve_drafter(spec: str | None = None, *, target_cfg=None, dtype=None
                    ) -> tuple[Drafter, dict, STSSets | None, Path]:
    """Load a drafter by shipped name or path. Returns (drafter, metadata, its STS sets (``sts.json``) or None,
    folder).

    Args:
      spec: ``"dspark"`` (default), ``"dflash"``, a `models.drafter_files.save_drafter` folder, a DeepSpec or a
        speculators checkpoint folder.
      target_cfg: the target's LlamaConfig, to check that the drafter fits it (width, vocabulary, tapped layers),
        before any weight is read where the format allows.
      dtype: parameter dtype of a DeepSpec or speculators drafter (default float32); our own folders load as
        float32.
    """
    path, kind = drafter_source(spec)
    if kind in ("deepspec", "speculators"):
        load = load_deepspec_drafter if kind == "deepspec" else load_speculators_drafter
        drafter, meta = load(path, target_cfg, dtype=jnp.float32 if dtype is None else dtype)
    else:
        drafter, meta = load_drafter(path)
        if target_cfg is not None:
            check_drafter_fits(drafter.cfg, target_cfg, path / "config.json")
    sts = path / "sts.json"
    temps = load_sts(sts) if sts.is_file() else None
    return drafter, meta, temps, path


def drafter_source(spec: str | None = None) -> tuple[Path, str]:
    """The folder and format (`drafter_format`) of a drafter given by shipped name or path, checked without
    reading any weight.

    Raises:
      ValueError: the folder is missing or holds no drafter format this package reads (naming what it expects).
    """
    spec = spec or "dspark"
    path = shipped_dir(spec) if spec in SHIPPED else Path(spec)
    kind = drafter_format(path)
    if kind is None:
        if spec in SHIPPED:
            raise ValueError(f"the shipped drafter {spec!r} is missing from this installation ({path}); "
                             f"train one (README, 'Training and calibrating a drafter') or pass --draft PATH")
        raise ValueError(f"--draft {spec}: expected one of {SHIPPED}, a drafter folder with config.json and "
                         f"weights.npz, a speculators checkpoint folder (config.json with speculators_model_type, "
                         f"and model.safetensors) or a DeepSpec checkpoint folder (config.json with target_layer_ids "
                         f"and block_size, and model.safetensors)")
    return path, kind


def precheck_for_model(spec: str | None, model: str | Path | None) -> None:
    """Check a drafter's config against a Hugging Face target folder's ``config.json`` (width, vocabulary,
    layers) before either is loaded, so that a drafter that cannot fit fails in a second, not after the target's
    weights were read. Does nothing for a GGUF target, a shipped drafter or an unrecognised folder (the loaders
    check those).

    Raises:
      ValueError: naming the drafter's config file, the field and what the target expects.
    """
    if spec is None or spec in SHIPPED or model is None:
        return
    model_cfg = Path(model) / "config.json"
    kind = drafter_format(spec)
    if kind is None or not model_cfg.is_file():
        return
    try:
        hf = json.loads(model_cfg.read_text())
        target = types.SimpleNamespace(vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]),
                                       n_layers=int(hf["num_hidden_layers"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return  # the target's loader reports what is wrong with its config
    target.tap_layers = default_tap_layers(target.n_layers)
    source = Path(spec) / "config.json"
    meta = json.loads(source.read_text())
    if kind == "deepspec":
        cfg = deepspec_drafter_config(meta, source)
        check_drafter_fits(cfg, target, source, num_target_layers=meta.get("num_target_layers"))
    elif kind == "speculators":
        check_drafter_fits(speculators_drafter_config(meta, source), target, source,
                           layer_field="aux_hidden_state_layer_ids", layer_offset=1)
    else:
        check_drafter_fits(DrafterConfig.from_dict(meta["config"]), target, source)


def tapped_for(target, drafter: Drafter):
    """The target (a `LlamaModel`) tapping the layers the drafter reads (``DrafterConfig.tap_layers``, e.g. a
    DeepSpec drafter's ``target_layer_ids``): the same weights and tokenizer with another ``tap_layers``, or the
    target itself when they already agree or the drafter records none."""
    taps = drafter.cfg.tap_layers
    if taps is None or tuple(taps) == tuple(target.cfg.tap_layers):
        return target
    return type(target)(dataclasses.replace(target.cfg, tap_layers=tuple(taps)), target.weights, target.tokenizer)


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
    with atomic_folder(out) as tmp:
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in names:
                shutil.copyfile(f, tmp / f.name)
        for f in attach:
            shutil.copyfile(f, tmp / f.name)
    return out
