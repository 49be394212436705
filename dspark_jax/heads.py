"""Training part of a drafter on a frozen rest: heads on a frozen backbone, or the confidence head alone.

A drafter (`models.drafter.Drafter`) is a backbone (context projection, draft layers, mask vector, final norm)
plus heads: the sequential head (Markov ``w1``/``w2`` or RNN ``w1``/``cell``/``w2``) and the confidence head
(``conf``, which also reads the Markov embedding ``w1``). Starting from an existing drafter (shipped, trained
here, or imported, anything `drafters.resolve_drafter` loads), `extend_drafter` builds the drafter to train:
the source's configuration with the heads asked for, every parameter the source has copied, the heads it lacks
initialised fresh (a new Markov ``w2`` starts at zero, so the drafter starts as its source). `trainable_filter`
names the parameters one training part updates; `training.train` differentiates only those and hands the rest
to the loss unchanged, so frozen parameters stay bit-identical and the backbone's backward pass is never
computed.

Parts (``--train`` of ``train.train_drafter``):

* ``all``: every parameter (the default; a fresh drafter or fine-tuning a whole one);
* ``heads``: the sequential and confidence heads (``w1``, ``w2``, ``cell``, ``conf``) on a frozen backbone,
  with the DSpark loss;
* ``confidence``: the confidence head alone (``conf``; also ``w1`` when there is no sequential head, since it
  then feeds the confidence head only), with the confidence BCE alone. The sequential head must already be
  trained: a head added now would stay at its fresh initialisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.training import LossConfig

__all__ = ["TRAIN_PARTS", "HEAD_MODULES", "head_config", "extend_drafter", "trainable_filter", "loss_for",
           "count_params"]

TRAIN_PARTS = ("all", "heads", "confidence")
HEAD_MODULES = ("w1", "w2", "cell", "conf")  # top-level attributes of `Drafter` that belong to the heads


def _check_part(part: str) -> None:
    if part not in TRAIN_PARTS:
        raise ValueError(f"train part {part!r}: expected one of {', '.join(TRAIN_PARTS)}")


def head_config(source: DrafterConfig, *, part: str = "heads", kind: str = "dspark", head: str | None = None,
                rank: int | None = None) -> DrafterConfig:
    """The configuration of a drafter trained from ``source``: its backbone, with the heads of ``kind``.

    Args:
      source: the starting drafter's configuration.
      part: ``all``, ``heads`` or ``confidence`` (what will be trained).
      kind: ``dspark`` (a sequential head and a confidence head) or ``dflash`` (neither; only with
        ``part="all"`` and a source without heads, since nothing is dropped silently).
      head: the sequential head for ``dspark``: ``markov``, ``rnn`` or ``none``; None keeps the source's, or
        adds a Markov head when the source has none. A source's trained head is never swapped for another.
      rank: the rank of a new Markov embedding (``w1``); None keeps the source's, else 256 (the spec's). A
        source that has ``w1`` fixes the rank.
    Returns:
      the new `DrafterConfig`.
    Raises:
      ValueError: naming the option and the source's value when the request does not fit the source.

    >>> src = DrafterConfig(vocab_size=64, dim=16, n_heads=2, n_kv_heads=1, head_dim=8, head="none",
    ...                     confidence=False)
    >>> cfg = head_config(src)
    >>> cfg.head, cfg.confidence, cfg.rank
    ('markov', True, 256)
    """
    _check_part(part)
    if kind not in ("dspark", "dflash"):
        raise ValueError(f"kind {kind!r}: expected 'dspark' or 'dflash'")
    has_heads = source.head != "none" or source.confidence
    if kind == "dflash":
        if part != "all":
            raise ValueError(f"--train {part}: a DFlash drafter has no heads to train; use --kind dspark")
        if has_heads:
            raise ValueError(f"--kind dflash: the source drafter has a {source.head} sequential head and "
                             f"confidence={source.confidence}; a DFlash drafter would drop them (start from a "
                             f"drafter without heads)")
        return source
    if head is None:
        head = source.head if source.head != "none" else "markov"
    if head not in ("markov", "rnn", "none"):
        raise ValueError(f"--head {head!r}: expected markov, rnn or none")
    if source.head != "none" and head != source.head:
        raise ValueError(f"--head {head}: the source drafter has a trained {source.head} head, which is kept "
                         f"(omit --head, or pass --head {source.head})")
    if source.uses_prev_token:
        if rank is not None and rank != source.rank:
            raise ValueError(f"--rank {rank}: the source drafter's Markov embedding has rank {source.rank}, "
                             f"which the heads share (omit --rank)")
        rank = source.rank
    elif rank is None:
        rank = 256
    if part == "confidence" and head != source.head:
        raise ValueError(f"--train confidence keeps the sequential head frozen, but the source drafter has "
                         f"{'no' if source.head == 'none' else 'a ' + source.head} sequential head and this "
                         f"run adds a {head} head, which would stay at its fresh initialisation; use --train "
                         f"heads (or --head {source.head})")
    return dataclasses.replace(source, head=head, confidence=True, rank=int(rank))


def _flat(module: nnx.Module, what) -> dict[tuple, Any]:
    return dict(nnx.to_flat_state(nnx.state(module, what)))


def extend_drafter(source: Drafter, cfg: DrafterConfig, *, seed: int = 0) -> tuple[Drafter, list[str]]:
    """A drafter with configuration ``cfg`` whose parameters are the source's where it has them.

    Args:
      source: the starting drafter (its parameters are copied, not shared).
      cfg: the new configuration (`head_config`): the same backbone, possibly more heads.
      seed: initialises the new heads.
    Returns:
      (drafter, fresh): the new drafter and the ``/``-joined paths of its freshly initialised parameters.
    Raises:
      ValueError: when a backbone parameter of ``cfg`` is missing from the source, or any parameter both have
        differs in shape (a different backbone or rank), naming the parameter.
    """
    new = Drafter(cfg, rngs=nnx.Rngs(seed), vocab_ids=jax.device_get(source.vocab_ids[...]))
    have = _flat(source, nnx.Param)
    fresh = []
    for path, var in nnx.to_flat_state(nnx.state(new, nnx.Param)):
        name = "/".join(map(str, path))
        old = have.get(path)
        if old is not None and old[...].shape == var[...].shape:
            var[...] = old[...].astype(var[...].dtype)
        elif old is None and path[0] in HEAD_MODULES:
            fresh.append(name)
        else:
            found = "missing" if old is None else f"of shape {old[...].shape}"
            raise ValueError(f"the source drafter's parameter {name} is {found}; expected shape "
                             f"{var[...].shape} (its configuration and weights disagree)")
    return new, fresh


def trainable_filter(part: str, cfg: DrafterConfig):
    """The `flax.nnx` filter of the parameters ``part`` trains (see the module docstring): for ``nnx.split``,
    ``nnx.state`` and `training.train`'s ``trainable``.

    Args:
      part: ``all``, ``heads`` or ``confidence``.
      cfg: the drafter's configuration (``confidence`` also trains ``w1`` when there is no sequential head).
    Returns:
      ``nnx.Param`` for ``all``, else a predicate ``(path, value) -> bool``.
    """
    _check_part(part)
    if part == "all":
        return nnx.Param
    names = set(HEAD_MODULES) if part == "heads" else {"conf"} | ({"w1"} if cfg.head == "none" else set())

    def select(path, value) -> bool:
        return isinstance(value, nnx.Param) and len(path) > 0 and path[0] in names

    return select


def loss_for(part: str, kind: str = "dspark") -> LossConfig:
    """The loss a part trains on: the DSpark loss, CE for DFlash, the confidence BCE alone for ``confidence``
    (the other terms do not reach the confidence head)."""
    _check_part(part)
    if kind == "dflash":
        return LossConfig.dflash()
    if part == "confidence":
        return LossConfig(ce=0.0, l1=0.0, conf=1.0)
    return LossConfig()


def count_params(drafter: Drafter, what=nnx.Param) -> int:
    """Number of scalar parameters matched by the filter ``what``."""
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(drafter, what))))
