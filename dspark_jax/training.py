"""Drafter training: the DSpark loss, the Optax optimiser, resumable Orbax checkpoints, metrics.

Loss (spec section 5), each term a weighted mean over block slots with weights ``w_k = exp(-k / 4)``
(0-indexed slots) times the valid mask:

* CE of the ground-truth token under the Markov-corrected draft distribution (temperature 1);
* L1 = ``||p_d - p_t||_1`` over the full target vocabulary (a reduced draft vocabulary puts zero draft mass
  on the other tokens, so their target mass counts in full);
* confidence BCE against ``c* = 1 - L1 / 2``, the exact acceptance probability of the slot given its
  prefix (detached);
* optionally (``kl`` > 0) a distillation term: the cross-entropy ``-sum_w p_t(w) log p_d(w)`` of the draft
  distribution against the target's over the draft vocabulary (the KL divergence up to the target's entropy,
  a constant). Every token of the target's distribution teaches, not only the sampled label; off by default.

``L = 0.1 CE + 0.9 L1 + 1.0 BCE`` for DSpark; a DFlash baseline uses ``L = CE``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.models.drafter import Drafter, draft_head_weights
from dspark_jax.models.llama import first_argmax
from dspark_jax.io import atomic_write_text

__all__ = ["LossConfig", "block_loss", "TrainConfig", "make_optimizer", "train", "validate", "replicate",
           "shard_batch", "choose_draft_vocab", "choose_mask_token", "init_layers_from_target"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0
    decay: float = 4.0  # w_k = exp(-k / decay)
    kl: float = 0.0  # distillation: soft cross-entropy against the target's distribution (module docstring)

    @classmethod
    def dflash(cls) -> "LossConfig":
        return cls(ce=1.0, l1=0.0, conf=0.0)


def block_loss(drafter: Drafter, batch: dict[str, jax.Array], embed: jax.Array, head_w: jax.Array,
               loss_cfg: LossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training loss of one batch of blocks.

    Args:
      drafter: the module.
      batch: ``taps`` [N, S, M, D], ``tokens`` [N, S], ``anchors`` [N, B], ``valid`` [N, B, G],
        ``final`` [N, B, G, D] (target final hidden at anchor + k), ``lse`` [N, B, G] (its log-partition).
      embed: [V, D] frozen target embedding; head_w: [D, W] frozen LM head over the draft vocabulary.
      loss_cfg: term weights.
    Returns:
      (loss, metrics): scalar loss; metrics hold the three terms and per-slot mean c* [G] (the expected
      acceptance rate of each slot given its prefix).
    """
    cfg = drafter.cfg
    G = cfg.block
    tokens, anchors = batch["tokens"], batch["anchors"]
    N, S = tokens.shape
    valid = batch["valid"].astype(jnp.float32)  # [N, B, G]
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (N, S))
    ctx_k, ctx_v = drafter.context_kv(batch["taps"].astype(jnp.float32), positions)  # [L, N, S, K, E]
    ctx_mask = jnp.arange(S)[None, None, :] < anchors[..., None]  # [N, B, S] strictly before the anchor
    anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1)  # [N, B]
    h = drafter.hidden(ctx_k, ctx_v, ctx_mask, anchor_tokens, anchors, embed)  # [N, B, G, D]
    pos = jnp.clip(anchors[..., None] + jnp.arange(G), 0, S - 1)  # [N, B, G] positions a + k
    prev = jnp.take_along_axis(tokens[:, None, :], pos, axis=2)  # x_{a+k}: the token before slot k's label
    labels = jnp.take_along_axis(tokens[:, None, :], jnp.clip(pos + 1, 0, S - 1), axis=2)
    logits, conf_logits = drafter.teacher_forced(h, prev, head_w)  # [N, B, G, W], [N, B, G]
    logp = jax.nn.log_softmax(logits, axis=-1)
    p_d = jnp.exp(logp)
    # Target probabilities on the draft vocabulary from the frozen head; the rest of its mass is outside.
    t_logits = jnp.einsum("nbgd,dw->nbgw", batch["final"].astype(jnp.float32), head_w.astype(jnp.float32))
    p_t = jnp.exp(t_logits - batch["lse"][..., None])
    outside = jnp.clip(1.0 - jnp.sum(p_t, axis=-1), 0.0, 1.0)
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1) + outside  # [N, B, G]
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    label_idx = drafter.to_draft[...][labels]
    in_vocab = label_idx < cfg.draft_vocab
    ce = -jnp.take_along_axis(logp, jnp.minimum(label_idx, cfg.draft_vocab - 1)[..., None], axis=-1)[..., 0]
    bce = optax.sigmoid_binary_cross_entropy(conf_logits, c_star)
    soft_ce = -jnp.sum(p_t * logp, axis=-1)  # [N, B, G]

    w = jnp.exp(-jnp.arange(G, dtype=jnp.float32) / loss_cfg.decay) * valid  # [N, B, G]
    w_ce = w * in_vocab

    def mean(x, ww):
        return jnp.sum(x * ww) / jnp.maximum(jnp.sum(ww), 1e-6)

    terms = {"ce": mean(ce, w_ce), "l1": mean(l1, w), "conf": mean(bce, w), "kl": mean(soft_ce, w)}
    loss = loss_cfg.ce * terms["ce"] + loss_cfg.l1 * terms["l1"]
    if loss_cfg.kl:  # at weight 0 the term is a metric only: no gradient pass over [N, B, G, W] for it
        loss = loss + loss_cfg.kl * terms["kl"]
    if cfg.confidence:
        loss = loss + loss_cfg.conf * terms["conf"]
    denom = jnp.maximum(jnp.sum(valid, axis=(0, 1)), 1.0)
    metrics = dict(terms, c_star=jnp.sum(c_star * valid, axis=(0, 1)) / denom,
                   top1=jnp.sum((first_argmax(logits) == label_idx) * valid, axis=(0, 1)) / denom)
    return loss, metrics


def probabilistic_tau(c_star: np.ndarray) -> float:
    """Expected accepted length 1 + sum_k prod_{i<=k} c*_i from per-slot acceptance rates."""
    return float(1.0 + np.sum(np.cumprod(np.asarray(c_star, np.float64))))


# ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    lr: float = 6e-4
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0
    warmup_frac: float = 0.04
    clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 100
    val_every: int = 100  # held-out metrics every N steps (and at the last), when a validation loader is given
    val_batches: int = 8  # batches 0..N-1 of the validation loader: the same blocks every time


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW, linear warmup over warmup_frac of the steps then cosine to 0, global-norm clipping."""
    warmup = max(1, int(round(tc.warmup_frac * tc.steps)))
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(tc.steps, warmup + 1), end_value=0.0)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(schedule, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay))


def _batch_to_device(b) -> dict[str, jax.Array]:
    return {"taps": jnp.asarray(b.taps), "tokens": jnp.asarray(b.tokens), "anchors": jnp.asarray(b.anchors),
            "valid": jnp.asarray(b.valid), "final": jnp.asarray(b.final), "lse": jnp.asarray(b.lse)}


def replicate(tree: Any, mesh) -> Any:
    """Every array of ``tree`` copied to every device of ``mesh`` (parameters, optimiser state, frozen
    target weights in data-parallel training)."""
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_batch(batch: dict[str, jax.Array], mesh) -> dict[str, jax.Array]:
    """A training batch split over the mesh's ``data`` axis by its leading axis N (`sharding.RULES`:
    ``batch -> data``; N not divisible by the data size: replicated). Jit then runs the step data-parallel:
    each device computes its share's gradients and XLA sums them (the loss is a mean over the whole batch,
    so the step equals the single-device one up to the order of the sums)."""
    from dspark_jax.sharding import Axes, place  # noqa: PLC0415

    axes = {k: Axes("batch", *([None] * (np.ndim(v) - 1))) for k, v in batch.items()}
    return place(batch, axes, mesh)


def _module_loss(graphdef, loss_cfg: LossConfig, params, buffers, batch, embed, lm_head):
    """`block_loss` of the module rebuilt from its trained and frozen state."""
    model = nnx.merge(graphdef, params, buffers)
    return block_loss(model, batch, embed, draft_head_weights(model, embed, lm_head), loss_cfg)


def make_train_step(graphdef, loss_cfg: LossConfig, tx: optax.GradientTransformation):
    """A jitted pure step (params, buffers, opt_state, batch, embed, lm_head) -> (params, opt_state, metrics).

    ``params`` are the trained parameters (differentiated and updated); ``buffers`` is the rest of the module
    state, frozen parameters included: it enters the loss as a constant, so no gradient flows into it.
    """

    loss_fn = functools.partial(_module_loss, graphdef, loss_cfg)

    @jax.jit
    def step(params, buffers, opt_state, batch, embed, lm_head):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch, embed, lm_head)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return params, opt_state, metrics

    return step


def make_eval_step(graphdef, loss_cfg: LossConfig):
    """A jitted pure (params, buffers, batch, embed, lm_head) -> metrics: the loss terms without a gradient."""

    @jax.jit
    def step(params, buffers, batch, embed, lm_head):
        loss, metrics = _module_loss(graphdef, loss_cfg, params, buffers, batch, embed, lm_head)
        return dict(metrics, loss=loss)

    return step


def validate(eval_step, params, buffers, val_loader, embed, lm_head, *, batches: int, mesh=None) -> dict[str, float]:
    """Held-out metrics over ``val_loader.batch(0 .. batches - 1)``: ``val_loss`` and ``val_tau_prob``, the
    probabilistic accepted length from the per-slot mean acceptance c* (the expected tau of the block when the
    target samples its own continuation, at G drafts)."""
    rows = []
    for i in range(batches):
        batch = _batch_to_device(val_loader.batch(i))
        if mesh is not None:
            batch = shard_batch(batch, mesh)
        rows.append(jax.device_get(eval_step(params, buffers, batch, embed, lm_head)))
    c_star = np.mean([np.asarray(r["c_star"]) for r in rows], axis=0)
    return {"val_loss": float(np.mean([r["loss"] for r in rows])), "val_c_star": c_star.tolist(),
            "val_tau_prob": probabilistic_tau(c_star)}


def validate_drafter(drafter: Drafter, val_loader, embed: jax.Array, lm_head: jax.Array | None, *,
                     loss_cfg: LossConfig, batches: int = 8) -> dict[str, float]:
    """`validate` of a drafter as it stands (no training): the same held-out metrics `train` logs."""
    graphdef, params, buffers = nnx.split(drafter, nnx.Param, ...)
    return validate(make_eval_step(graphdef, loss_cfg), params, buffers, val_loader, embed, lm_head,
                    batches=batches)


def train(drafter: Drafter, loader, embed: jax.Array, lm_head: jax.Array | None, *, tc: TrainConfig,
          loss_cfg: LossConfig, run_dir: str | os.PathLike, progress: bool = True, trainable=nnx.Param, mesh=None,
          val_loader=None) -> Drafter:
    """Train ``drafter`` on ``loader.batch(step)`` for ``tc.steps`` steps; resumable from ``run_dir``.

    Only the parameters matched by the `flax.nnx` filter ``trainable`` are trained (default: all of them;
    `heads.trainable_filter` names the heads or the confidence head); the others are not differentiated and
    come back bit-identical.

    With a device ``mesh`` (`sharding.make_mesh`) the step runs data-parallel: each batch is split over the
    ``data`` axis (`shard_batch`), parameters, optimiser state and the frozen target head are replicated.

    Checkpoints (params, optimiser state, step) go to ``run_dir/ckpt`` with Orbax every ``ckpt_every``
    steps (written to a temporary folder and renamed, so an interrupted save never corrupts the latest
    one); a restarted call resumes from the latest checkpoint and, because batches are a function of the
    step, sees the same data it would have seen. Checkpoints hold the trained parameters only: a resumed
    call must be given the same frozen parameters (``train.train_drafter`` checks its run's configuration).
    Metrics go to ``run_dir/metrics.jsonl``; with a ``val_loader`` (blocks of held-out sequences), every
    ``tc.val_every`` steps and at the last, the logged row also holds `validate`'s held-out metrics.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    run_dir = Path(run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    tx = make_optimizer(tc)
    graphdef, params, buffers = nnx.split(drafter, trainable, ...)  # buffers: frozen parameters too
    if not jax.tree.leaves(params):
        raise ValueError("train: the trainable filter matches no parameter of the drafter")
    opt_state = tx.init(params)
    mgr = ocp.CheckpointManager(run_dir / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    latest = mgr.latest_step()
    if latest is not None:
        target = {"params": params, "opt_state": opt_state}
        restored = mgr.restore(latest, args=ocp.args.StandardRestore(target))
        params, opt_state, start = restored["params"], restored["opt_state"], latest
    step_fn = make_train_step(graphdef, loss_cfg, tx)
    eval_fn = make_eval_step(graphdef, loss_cfg) if val_loader is not None else None
    if mesh is not None:
        params, buffers, opt_state, embed, lm_head = replicate((params, buffers, opt_state, embed, lm_head), mesh)
    metrics_path = run_dir / "metrics.jsonl"
    writer = jax.process_index() == 0  # one process of a multi-process run writes the metrics (Orbax: its own rule)
    if writer and start == 0 and metrics_path.exists():
        metrics_path.unlink()
    elif writer and start > 0 and metrics_path.exists():  # drop lines logged after the checkpoint we resume from
        kept = [row for row in metric_rows(metrics_path) if row["step"] <= start]
        atomic_write_text(metrics_path, "".join(json.dumps(row) + "\n" for row in kept))
    bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", disable=not progress)
    t_last = time.perf_counter()
    acc: list[dict[str, Any]] = []
    saved = done = start
    try:
        for step in range(start, tc.steps):
            batch = _batch_to_device(loader.batch(step))
            if mesh is not None:
                batch = shard_batch(batch, mesh)
            params, opt_state, m = step_fn(params, buffers, opt_state, batch, embed, lm_head)
            acc.append(m)
            done = step + 1
            if done % tc.log_every == 0 or done == tc.steps:
                host = jax.device_get(acc)
                acc = []
                now = time.perf_counter()
                row = {"step": done, "seconds_per_step": (now - t_last) / len(host)}
                t_last = now
                for key in host[0]:
                    vals = np.stack([np.asarray(h[key]) for h in host])
                    row[key] = vals.mean(0).tolist()
                row["tau_prob"] = probabilistic_tau(row["c_star"])
                if eval_fn is not None and (done % tc.val_every < tc.log_every or done == tc.steps):
                    row.update(validate(eval_fn, params, buffers, val_loader, embed, lm_head, batches=tc.val_batches,
                                        mesh=mesh))
                if writer:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['tau_prob']:.2f}")
            if done % tc.ckpt_every == 0 or done == tc.steps:
                mgr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
                saved = done
            bar.update(1)
    except KeyboardInterrupt:  # Ctrl-C: checkpoint the steps since the last save, then stop
        if done > saved:
            mgr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), force=True)
        raise
    finally:
        mgr.wait_until_finished()
        mgr.close()
        bar.close()
    return nnx.merge(graphdef, params, buffers)


def metric_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a training run's ``metrics.jsonl``; a line cut short by an interruption is dropped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


# ------------------------------------------------------------------------------------------------------------
def choose_draft_vocab(frequencies: np.ndarray, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The ``size`` most frequent tokens (ties by id) plus ``always`` (e.g. EOS), as sorted ids.

    Returns all ids when ``size`` is 0 or covers the vocabulary.
    """
    v = len(frequencies)
    if size <= 0 or size >= v:
        return np.arange(v, dtype=np.int32)
    order = np.lexsort((np.arange(v), -np.asarray(frequencies)))
    must = [int(t) for t in always]
    chosen = [t for t in order[: size] if t not in must][: size - len(must)] + must
    return np.sort(np.asarray(chosen, np.int32))


def choose_mask_token(tokenizer, vocab_size: int, seen: np.ndarray | None = None) -> tuple[int, str]:
    """A token id whose embedding row can stand for the block slots (``DrafterConfig.mask_token``): one the target
    never produces in text, so that the row means "a slot to draft" and nothing else. In order:

    1. a special token of the tokenizer that names a mask (``<mask>``, ``<|MASK|>``): speculators takes the
       tokenizer's mask token first, and DeepSpec's Gemma configs use its ``<mask>`` (id 4);
    2. the first embedding row past the tokenizer's tokens (``tokenizer.vocab_size`` when the embedding has more
       rows): no text encodes to it. Speculators adds its ``<|MASK|>`` there, and DeepSpec's Qwen3 configs use
       151669, Qwen3's first such row;
    3. the special token of highest id that is not BOS, EOS, PAD or a stop id, is not written in the chat
       template and never occurs in ``seen``. SmolLM2 has neither of the above and every row is a token: this
       picks ``<empty_output>`` (16), one of the code-metadata tokens (``<repo_name>`` .. ``<empty_output>``,
       3..16) of its pretraining data, which a chat never writes. (Speculators' last resort, the PAD token, is
       SmolLM2's EOS, which every answer ends with.)

    Tokens that occur in ``seen`` (the training cache's counts, prompts included) are never picked.

    Args:
      tokenizer: the target's tokenizer (`tokenizer.Tokenizer` or `tokenizer.HFTokenizer`; what it lacks of
        ``backend``, ``vocab_size``, the special ids and ``chat_template`` counts as absent).
      vocab_size: the target's embedding rows V.
      seen: int [V] token counts, or None.
    Returns:
      (token id, why it was picked).
    Raises:
      ValueError: when no token qualifies (then name one with ``--mask-token ID``).

    >>> import types
    >>> choose_mask_token(types.SimpleNamespace(vocab_size=60), 64)[0]  # a tokenizer of 60 tokens, 64 rows
    60
    """
    seen = np.zeros(vocab_size, np.int64) if seen is None else np.asarray(seen)
    backend = getattr(tokenizer, "backend", None)
    added = {} if backend is None else backend.get_added_tokens_decoder()
    specials = {int(i): str(t.content) for i, t in added.items() if t.special and 0 <= int(i) < vocab_size}
    used = {getattr(tokenizer, name, None) for name in ("bos_id", "eos_id", "pad_id")}
    used |= {int(i) for i in getattr(tokenizer, "stop_ids", ())}
    template = getattr(tokenizer, "chat_template", None) or ""
    free = [i for i, text in sorted(specials.items()) if i not in used and text not in template and not seen[i]]
    named = [i for i in free if "mask" in specials[i].lower()]
    if named:
        return named[0], f"the tokenizer's mask token {specials[named[0]]!r}"
    size = int(getattr(tokenizer, "vocab_size", vocab_size))
    if size < vocab_size and not seen[size]:
        return size, f"row {size}, the first embedding row past the tokenizer's {size} tokens (no text encodes to it)"
    if free:
        return free[-1], (f"the special token {specials[free[-1]]!r}: not BOS, EOS, PAD or a stop token, not in the "
                          f"chat template, absent from the training cache")
    raise ValueError("found no token the target never writes (no mask token, no embedding row past the tokenizer's "
                     "tokens, no unused special token); name one with --mask-token ID")


def init_layers_from_target(drafter: Drafter, weights, layers, *, context_tap: int | None = -1) -> Drafter:
    """Start the drafter's decoder layers (and its final norm) from the target's own: drafter layer j takes
    target layer ``layers[j]``'s norms and projections. With ``context_tap``, the context features start as
    that tapped layer alone, normalised as the first copied layer normalises its input (the context
    projection selects the tap; the context norm takes that layer's attention-norm scale): the first drafter
    layer's context keys and values then start as the target layer's own over those states. The heads keep
    their fresh initialisation, and so do a QK-norm drafter's query and key norm scales (ones) when the target
    has no QK-norm to copy. Modifies ``drafter`` in place and returns it.

    Args:
      drafter: a fresh drafter at the target's width (`DrafterConfig.for_target`, the target's FFN width).
      weights: the target's `LlamaWeights` (float, not quantized).
      layers: target layer indices, one per drafter layer (negative ones count from the last).
      context_tap: index into the drafter's taps (-1: the deepest), or None to keep the context projection
        and norm fresh.
    Raises:
      ValueError: a count, index or shape that does not fit, or a target with attention biases (the drafter
        has none).

    >>> from flax import nnx
    >>> from dspark_jax.models.llama import LlamaConfig, init_random_weights
    >>> from dspark_jax.models.drafter import Drafter, DrafterConfig
    >>> tcfg = LlamaConfig.tiny(vocab_size=64)
    >>> w = init_random_weights(tcfg, jax.random.key(0))
    >>> d = Drafter(DrafterConfig.for_target(tcfg, n_layers=1, block=3), rngs=nnx.Rngs(0))
    >>> d = init_layers_from_target(d, w, [-1])
    >>> bool(jnp.all(d.layers[0].w_down.kernel[...] == w.layers[-1].w_down))
    True
    >>> init_layers_from_target(d, w, [0, 1])
    Traceback (most recent call last):
    ...
    ValueError: init layers [0, 1]: expected one target layer per drafter layer (1)
    """
    cfg = drafter.cfg
    n = len(weights.layers)
    idx = [int(i) for i in layers]
    if len(idx) != cfg.n_layers:
        raise ValueError(f"init layers {idx}: expected one target layer per drafter layer ({cfg.n_layers})")
    if any(not -n <= i < n for i in idx):
        raise ValueError(f"init layers {idx}: the target has layers 0..{n - 1} (or -{n}..-1)")
    pairs = [("attn_norm", "scale"), ("wq", "kernel"), ("wk", "kernel"), ("wv", "kernel"), ("wo", "kernel"),
             ("mlp_norm", "scale"), ("w_gate", "kernel"), ("w_up", "kernel"), ("w_down", "kernel")]
    if cfg.qk_norm:
        pairs += [("q_norm", "scale"), ("k_norm", "scale")]
    for j, i in enumerate(idx):
        src = weights.layers[i]
        if getattr(src, "bq", None) is not None:
            raise ValueError("init layers: the target's attention has biases, which the drafter's layers lack")
        for name, param in pairs:
            value = getattr(src, name)
            if value is None and name in ("q_norm", "k_norm"):
                continue  # a target without QK-norm (SmolLM2): the drafter's scales stay at ones
            var = getattr(getattr(drafter.layers[j], name), param)
            if value is None or tuple(value.shape) != tuple(var[...].shape):
                raise ValueError(f"init layers: target layer {i}'s {name} has shape "
                                 f"{None if value is None else tuple(value.shape)}, drafter layer {j}'s "
                                 f"{tuple(var[...].shape)}; build the drafter at the target's width and FFN")
            var[...] = jnp.asarray(value, var[...].dtype)
    drafter.final_norm.scale[...] = jnp.asarray(weights.final_norm, drafter.final_norm.scale[...].dtype)
    if context_tap is not None:
        M, D = cfg.n_taps, cfg.dim
        if not -M <= context_tap < M:
            raise ValueError(f"init context tap {context_tap}: the drafter has taps 0..{M - 1} (or -{M}..-1)")
        kernel = drafter.ctx_proj.kernel
        select = np.zeros((M, D, D), np.float32)
        select[context_tap % M] = np.eye(D, dtype=np.float32)
        kernel[...] = jnp.asarray(select.reshape(M * D, D), kernel[...].dtype)
        drafter.ctx_norm.scale[...] = jnp.asarray(weights.layers[idx[0]].attn_norm, drafter.ctx_norm.scale[...].dtype)
    return drafter
