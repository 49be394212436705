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

`convert_drafter` goes further, for fine-tuning a drafter into another form (``train.train_drafter --init-from``
with ``--portable``, ``--qk-norm``, ``--tap-norm`` / ``--no-tap-norm``, ``--mask-token`` or ``--draft-vocab``): the
backbone switches ``qk_norm``, ``tap_norm`` and ``mask_token`` and the draft vocabulary may differ from the
source's. What maps is copied (layers, context projection, heads), what has no counterpart starts fresh (QK-norm
scales at ones) and what has no place is dropped, each named (`Conversion`).

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
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.training import LossConfig

__all__ = ["TRAIN_PARTS", "HEAD_MODULES", "SWITCHES", "head_config", "Conversion", "fit_qk_norm_scales",
           "convert_drafter", "extend_drafter", "trainable_filter", "loss_for", "count_params"]

TRAIN_PARTS = ("all", "heads", "confidence")
HEAD_MODULES = ("w1", "w2", "cell", "conf")  # top-level attributes of `Drafter` that belong to the heads
# Configuration fields `convert_drafter` may change besides the heads': the backbone switches and the vocabulary.
SWITCHES = ("qk_norm", "tap_norm", "mask_token", "draft_vocab_size")
HEAD_FIELDS = ("head", "confidence", "rank")


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


def _switch_param(path: tuple) -> bool:
    """Whether a parameter exists or not by a backbone switch (`SWITCHES`): per-tap norm scales, the learned
    mask vector, the draft layers' query and key norms."""
    return path[0] in ("tap_scale", "mask_embed") or (path[0] == "layers" and path[2] in ("q_norm", "k_norm"))


@dataclasses.dataclass
class Conversion:
    """What `convert_drafter` made: the drafter, and the ``/``-joined paths of its parameters initialised fresh
    (``fresh``), of the source's parameters it has no place for (``dropped``), and notes on the parameters copied
    with a change (``adapted``)."""

    drafter: Drafter
    fresh: list[str]
    dropped: list[str]
    adapted: list[str]


def fit_qk_norm_scales(source: Drafter, batch, embed: jax.Array) -> np.ndarray:
    """Query and key norm scales for a QK-norm version of ``source`` (a drafter without QK-norm) that keep its
    queries and keys as close to the source's as a norm allows: per draft layer and head dimension e, the
    least-squares g_e of ``q_e ~ g_e q_e / rms(q)`` over the batch's block queries (keys: the block's and the
    context's), ``g_e = E[q_e^2 / rms(q)] / E[q_e^2 / rms(q)^2]``. Exact where every vector has the same RMS;
    scales of ones would instead divide every attention logit by the two vectors' RMS.

    Args:
      source: the drafter without QK-norm.
      batch: a `data.BlockBatch` (taps, tokens, anchors) of the training cache.
      embed: [V, D] the target's embedding.
    Returns:
      float32 [L, 2, E]: per layer, the query scales then the key scales.
    """
    taps = jnp.asarray(batch.taps, jnp.float32)
    tokens, anchors = jnp.asarray(batch.tokens), jnp.asarray(batch.anchors)
    N, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (N, S))
    h_ctx = source.context_features(taps)  # [N, S, D]
    ctx_k, ctx_v = source.context_kv(taps, positions)
    ctx_mask = jnp.arange(S)[None, None, :] < anchors[..., None]
    inputs = source.layer_inputs(ctx_k, ctx_v, ctx_mask, jnp.take_along_axis(tokens, anchors, axis=1), anchors, embed)
    E = source.cfg.head_dim

    def fit(vectors) -> np.ndarray:
        x = np.concatenate([np.asarray(jax.device_get(v), np.float32).reshape(-1, E) for v in vectors])
        rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
        x, rms = x[rms[:, 0] > 0], rms[rms[:, 0] > 0]  # padded context positions: zero vectors
        return np.sum(x * x / rms, axis=0) / np.maximum(np.sum(x * x / rms**2, axis=0), 1e-12)

    out = []
    for layer, x in zip(source.layers, inputs):
        h = layer.attn_norm(x)
        out.append((fit([layer.wq(h)]), fit([layer.wk(h), layer.wk(h_ctx)])))
    return np.asarray(out, np.float32)


def convert_drafter(source: Drafter, cfg: DrafterConfig, *, seed: int = 0, vocab_ids: np.ndarray | None = None,
                    tap_rms: np.ndarray | None = None, qk_scales: np.ndarray | None = None) -> Conversion:
    """A drafter with configuration ``cfg`` started from ``source``: every parameter that maps is copied.

    ``cfg`` may differ from the source's configuration in the heads (`head_config`) and in `SWITCHES`:

    * ``qk_norm`` on: the query and key norm scales are new (fresh): ``qk_scales`` (`fit_qk_norm_scales`), else
      ones; off: they are dropped.
    * ``tap_norm`` off: the per-tap scales are dropped and folded into the context projection: the rows of tap m
      are multiplied by its scale over ``tap_rms[m]``, its typical RMS (`data.tap_rms`), so that the raw tap
      reaches the projection at the size the normalised one had (exact for a token whose taps have their
      typical RMS; the context norm after the projection absorbs an overall factor). On: the scales start at
      ones and the rows are multiplied by ``tap_rms[m]``. Without ``tap_rms`` nothing is folded.
    * ``mask_token`` set where the source learned a mask vector: the vector is dropped (the block slots become
      the target's embedding row); unset: a fresh vector.
    * the draft vocabulary (``vocab_ids``, ``cfg.draft_vocab_size``): the Markov embedding's rows and ``w2``'s
      columns follow their tokens; a token new to it starts as the source did for every token outside its
      vocabulary (the shared out-of-vocabulary row of ``w1``, no ``w2`` bias).

    Args:
      source: the starting drafter (its parameters are copied, not shared).
      cfg: the new configuration.
      seed: initialises what starts fresh.
      vocab_ids: the new draft vocabulary's sorted token ids (None: the source's).
      tap_rms: float [M], each tapped layer's typical RMS (when ``tap_norm`` changes).
      qk_scales: float [L, 2, E], the query and key norm scales to start from (when ``qk_norm`` is switched on).
    Returns:
      a `Conversion`.
    Raises:
      ValueError: naming the fields when ``cfg`` differs from the source's in anything else (width, layers,
        block, ...), or the vocabulary of a drafter with its own LM head changes; naming the parameter when the
        source's configuration and weights disagree.
    """
    src = source.cfg
    keep = {f: getattr(src, f) for f in SWITCHES + HEAD_FIELDS}
    other = sorted(f for f, v in dataclasses.asdict(dataclasses.replace(cfg, **keep)).items()
                   if v != getattr(src, f))
    if other:
        raise ValueError(f"the new drafter differs from its source in {', '.join(other)}; only the heads, "
                         f"{', '.join(SWITCHES)} may change")
    old_ids = np.asarray(jax.device_get(source.vocab_ids[...]))
    ids = old_ids if vocab_ids is None else np.asarray(vocab_ids, np.int32)
    new_vocab = not np.array_equal(ids, old_ids)
    if new_vocab and (src.own_embeddings or cfg.own_embeddings):
        raise ValueError("the draft vocabulary of a drafter with its own LM head copy (a DeepSpec import) is kept")
    new = Drafter(cfg, rngs=nnx.Rngs(seed), vocab_ids=ids)
    have = _flat(source, nnx.Param)
    fresh, adapted = [], []
    W_old = src.draft_vocab
    row = np.asarray(jax.device_get(source.to_draft[...]))[ids]  # [W_new] the source's index (W_old: outside)
    fold = None
    if src.tap_norm != cfg.tap_norm and tap_rms is not None:
        rms = np.asarray(tap_rms, np.float32).reshape(-1, 1)  # [M, 1]
        scale = np.asarray(have[("tap_scale",)][...], np.float32) / rms if src.tap_norm else rms  # [M, D] or [M, 1]
        fold = np.broadcast_to(scale, (cfg.n_taps, cfg.dim)).reshape(-1, 1)  # [M * D, 1] per kernel row
    for path, var in nnx.to_flat_state(nnx.state(new, nnx.Param)):
        name = "/".join(map(str, path))
        old = have.get(path)
        if old is None:
            if path[0] in HEAD_MODULES or _switch_param(path):
                fresh.append(name)
                if qk_scales is not None and path[0] == "layers" and path[2] in ("q_norm", "k_norm"):
                    var[...] = jnp.asarray(qk_scales[path[1], int(path[2] == "k_norm")], var[...].dtype)
                continue
            raise ValueError(f"the source drafter's parameter {name} is missing; expected shape {var[...].shape} "
                             f"(its configuration and weights disagree)")
        value = np.asarray(jax.device_get(old[...]), np.float32)
        if new_vocab and name == "w1/embedding":  # [W + 1, r]: the last row is every outside token's
            outside = value[W_old:] if cfg.draft_vocab < cfg.vocab_size else np.zeros_like(value[W_old:])
            value = np.concatenate([value[row], outside], axis=0)  # (none outside a full vocabulary: zero)
        elif new_vocab and name == "w2/kernel":  # [r, W]
            value = np.where(row < W_old, value[:, np.minimum(row, W_old - 1)], 0.0)
        elif fold is not None and name == "ctx_proj/kernel":  # [M * D, D]
            value = value * fold
            adapted.append(f"{name}: each tap's rows scaled by " + (
                "its dropped norm scale over its typical RMS (the per-tap norms folded in)" if src.tap_norm else
                "its typical RMS (the new per-tap norms start at ones)"))
        if value.shape != tuple(var[...].shape):
            raise ValueError(f"the source drafter's parameter {name} is of shape {value.shape}; expected shape "
                             f"{var[...].shape} (its configuration and weights disagree)")
        var[...] = jnp.asarray(value, var[...].dtype)
    mine = {p for p, _ in nnx.to_flat_state(nnx.state(new, nnx.Param))}
    if new_vocab:
        mapped = [n for n in ("w1/embedding", "w2/kernel") if tuple(n.split("/")) in mine]
        follow = (f"; {', '.join(mapped)} follow their tokens, a new token starting as the source's "
                  f"out-of-vocabulary tokens: the shared w1 row, no w2 bias") if mapped else ""
        adapted.append(f"the draft vocabulary goes from {W_old} to {cfg.draft_vocab} tokens "
                       f"({int(np.sum(row == W_old))} new{follow})")
    if cfg.qk_norm and not src.qk_norm:
        adapted.append("layers/*/q_norm/scale, layers/*/k_norm/scale: " + (
            "fitted to the source's queries and keys (fit_qk_norm_scales)" if qk_scales is not None else "ones"))
    dropped = sorted("/".join(map(str, p)) for p in have if p not in mine)
    if src.tap_norm and not cfg.tap_norm and fold is None:
        adapted.append("ctx_proj/kernel: copied as it is (no tap RMS given: the dropped per-tap norms not folded in)")
    bad = ["/".join(map(str, p)) for p in have if p not in mine and not _switch_param(p)]
    if bad:
        raise ValueError(f"the new drafter has no place for the source's {', '.join(bad)}")
    return Conversion(new, fresh, dropped, adapted)


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
    conv = convert_drafter(source, cfg, seed=seed)
    return conv.drafter, conv.fresh


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
