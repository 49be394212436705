"""vLLM speculators DSpark and DFlash checkpoints in this project's `Drafter`, and back.

The speculators library (vLLM's, Apache-2.0; format of version 0.9.0) writes a drafter as ``config.json`` with
``speculators_model_type`` ``"dspark"`` or ``"dflash"`` and ``model.safetensors``; vLLM serves it with
``--speculative-config '{"method": "dspark", "model": FOLDER, ...}'``. Its architecture is DeepSpec's (the tensor
names are DeepSpec's too, `dspark_jax.models.deepspec.shared_tensor_map`), with these differences:

- The draft layers' config is nested, ``transformer_layer_config`` (a Qwen3 config: QK-norm, SwiGLU, RoPE).
- No embedding is stored, and no LM head for a full draft vocabulary: both are the target's (the verifier's),
  and the block slots are embedded as the target's row ``mask_token_id`` (ours: ``own_embeddings=False`` and
  ``mask_token``). A reduced draft vocabulary (``draft_vocab_size`` W < V) stores ``lm_head.weight`` [W, D], the
  verifier's rows, frozen in training: this engine takes them from the target, as for any drafter sharing it.
- The draft vocabulary: ``d2t`` [W] int64 offsets (draft index i is token ``i + d2t[i]``) and ``t2d`` [V] bool
  (which tokens are in it): our ``DrafterConfig.draft_vocab_size`` and ``Drafter.vocab_ids``. ``markov_w1`` keeps
  a row per target token [V, r]; ours keeps the draft vocabulary's rows and one row shared by every other token,
  so a checkpoint whose rows outside the draft vocabulary differ is refused (our own exports never have that).
- ``aux_hidden_state_layer_ids``: id j is the hidden state *entering* decoder layer j (Hugging Face's
  ``hidden_states[j]``, 0 being the embedding output), which is the output of layer j - 1: our ``tap_layers`` are
  the ids minus one. (speculators' DFlash converter says so: z-lab's ``target_layer_ids`` i, read as
  ``hidden_states[i + 1]``, become ids ``i + 1``; vLLM captures a layer's input residual stream.) Id 0 and the
  target's final layer are refused.
- ``block_size`` G with ``sample_from_anchor``: true (DSpark's default, DeepSpec's convention) means the block
  ``[x0, MASK, ...]`` drafts G tokens, slot k predicting x_{k+1}: ours. False (DFlash's default, z-lab's) makes
  slot 0 the bonus position and drafts G - 1 tokens from slots 1..G-1; that is refused (a `Drafter` change).
- No place for STS temperatures or calibration: `save_speculators_drafter` copies ``sts.json`` /
  ``calibration.json`` beside the weights (``attach``), read back here and ignored by speculators and vLLM.

Axis legend: V target vocabulary, W draft vocabulary, D width, r Markov rank, G block.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.io import read_json_object
from dspark_jax.models.deepspec import (MARKOV_HEADS, WEIGHTS, Tensor, check_drafter_fits, check_layer_ids,
                                        check_tensor_headers, config_field, file_tensors, qwen3_config,
                                        qwen3_layer_fields, read_drafter, sequential_head_fields, shared_tensor_map,
                                        target_embedding_and_head, weight_files, writable_taps, write_checkpoint)
from dspark_jax.models.drafter import Drafter, DrafterConfig

__all__ = ["SPECULATORS_TYPES", "speculators_model_type", "speculators_drafter_config", "speculators_refusals",
           "load_speculators_drafter", "save_speculators_drafter"]

SPECULATORS_TYPES = ("dspark", "dflash")  # speculators_model_type values read and written here
FORMAT_VERSION = "0.9.0"
ARCHITECTURES = {"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel"}
# Fields with defaults in speculators' config classes, as those classes fill them in when absent.
DEFAULTS = {"dspark": dict(block_size=8, sample_from_anchor=True, markov_rank=256, markov_head_type="vanilla",
                           enable_confidence_head=True, confidence_head_with_markov=True),
            "dflash": dict(block_size=8, sample_from_anchor=False)}
LAYERS = "transformer_layer_config."
HINT = ("markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov, draft_vocab_size, "
        "transformer_layer_config.num_hidden_layers")


def speculators_model_type(path: str | os.PathLike) -> str | None:
    """The ``speculators_model_type`` of a folder's ``config.json`` (any value, read or not), else None.

    >>> speculators_model_type("no/such/folder") is None
    True
    """
    try:
        hf = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    kind = hf.get("speculators_model_type") if isinstance(hf, dict) else None
    return None if kind is None else str(kind)


def speculators_drafter_config(hf: dict, source: str | os.PathLike = "config.json") -> DrafterConfig:
    """Our `DrafterConfig` for a speculators DSpark or DFlash ``config.json`` (parsed), with every field checked.

    Args:
      hf: the parsed config.
      source: the file's path, for error messages.
    Returns:
      the config: Qwen3 layers (``qk_norm``), the target's embedding and LM head (``own_embeddings`` False), the
      mask token's row, ``tap_layers`` = ``aux_hidden_state_layer_ids`` - 1, the draft vocabulary's size.
    Raises:
      ValueError: naming the file, the field and what was expected; another ``speculators_model_type`` (DFlash2,
        Eagle3, MTP, ...) by name, with what is supported.

    >>> layers = dict(model_type="qwen3", hidden_size=32, vocab_size=64, num_hidden_layers=1, num_attention_heads=4,
    ...               num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e6)
    >>> hf = dict(speculators_model_type="dspark", transformer_layer_config=layers, draft_vocab_size=16,
    ...           block_size=4, aux_hidden_state_layer_ids=[1, 2], mask_token_id=63, markov_rank=8)
    >>> c = speculators_drafter_config(hf)
    >>> c.head, c.tap_layers, c.draft_vocab, c.mask_token, c.own_embeddings, c.qk_norm
    ('markov', (0, 1), 16, 63, False, True)
    """
    src = Path(source)
    if not isinstance(hf, dict):
        raise ValueError(f"{src}: expected a JSON object")
    kind = hf.get("speculators_model_type")
    if kind not in SPECULATORS_TYPES:
        raise ValueError(f"{src}: field 'speculators_model_type' = {kind!r}: only speculators DSpark and DFlash "
                         f"drafters are read ({', '.join(map(repr, SPECULATORS_TYPES))}); DFlash2, Eagle3, MTP, "
                         f"P-EAGLE and XPress drafters have other architectures")
    hf = {**DEFAULTS[kind], **hf}
    layers = qwen3_layer_fields(config_field(hf, "transformer_layer_config", src, dict), src, LAYERS)
    vocab, dim = layers["vocab_size"], layers["dim"]
    draft_vocab = config_field(hf, "draft_vocab_size", src)
    if not 1 <= draft_vocab <= vocab:
        raise ValueError(f"{src}: field 'draft_vocab_size' = {draft_vocab}, expected 1..{vocab} (the target "
                         f"vocabulary, {LAYERS}vocab_size)")
    if not config_field(hf, "sample_from_anchor", src, bool):
        raise ValueError(f"{src}: field 'sample_from_anchor' = false: slot 0 of each block is then the bonus "
                         f"token's and the drafts come from slots 1..block_size-1, where this engine's drafter "
                         f"predicts x(k+1) from slot k; only sample_from_anchor = true (DSpark's default, DeepSpec's "
                         f"convention) is read")
    ids = hf.get("aux_hidden_state_layer_ids")
    if ids is None:
        raise ValueError(f"{src}: field 'aux_hidden_state_layer_ids' is missing (the target layers the drafter "
                         f"reads)")
    ids = check_layer_ids(ids, src, "aux_hidden_state_layer_ids", 1, "the target's embedding output")
    target_dim = hf.get("target_hidden_size")
    if target_dim is not None and target_dim != dim:
        raise ValueError(f"{src}: field 'target_hidden_size' = {target_dim!r}: only a target as wide as the drafter "
                         f"({LAYERS}hidden_size = {dim}) is supported")
    mask = hf.get("mask_token_id")
    if mask is None:
        raise ValueError(f"{src}: field 'mask_token_id' is missing or null: the block slots are the target's "
                         f"embedding row mask_token_id")
    mask = config_field(hf, "mask_token_id", src)
    if not 0 <= mask < vocab:
        raise ValueError(f"{src}: field 'mask_token_id' = {mask}, expected a token id in [0, {vocab})")
    if kind == "dspark":
        heads = sequential_head_fields(hf, src)
    else:
        heads = dict(head="none", rank=1, confidence=False)
    try:
        return DrafterConfig(**layers, **heads, n_taps=len(ids), block=config_field(hf, "block_size", src),
                             draft_vocab_size=0 if draft_vocab == vocab else draft_vocab, qk_norm=True,
                             mask_token=mask, own_embeddings=False, tap_layers=tuple(i - 1 for i in ids))
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from err


def _vocab_ids(files: dict[str, Path], cfg: DrafterConfig, source: Path) -> np.ndarray:
    """[W] the draft vocabulary's token ids from ``d2t`` and ``t2d``, both checked (read, they are small)."""
    from safetensors import safe_open  # noqa: PLC0415

    W, V = cfg.draft_vocab, cfg.vocab_size
    maps = {}
    for name, kinds in (("d2t", ("I64", "I32")), ("t2d", ("BOOL",))):
        with safe_open(str(files[name]), framework="numpy") as f:
            dtype = f.get_slice(name).get_dtype()
            if dtype not in kinds:
                raise ValueError(f"{files[name]}: tensor {name!r} is {dtype}, expected {' or '.join(kinds)}")
            maps[name] = f.get_tensor(name)
    ids = np.arange(W, dtype=np.int64) + maps["d2t"].astype(np.int64)
    where = f"{files['d2t']}: tensor 'd2t' (draft index i is token i + d2t[i])"
    if ids[0] < 0 or ids[-1] >= V or np.any(np.diff(ids) <= 0):
        raise ValueError(f"{where} gives token ids {ids[:4].tolist()}...: expected {W} strictly increasing ids in "
                         f"[0, {V})")
    marked = int(maps["t2d"].sum())
    if marked != W:
        raise ValueError(f"{files['t2d']}: tensor 't2d' marks {marked} tokens, but draft_vocab_size is {W} "
                         f"(from {source})")
    if not maps["t2d"][ids].all():
        raise ValueError(f"{where} and tensor 't2d' disagree on {int((~maps['t2d'][ids]).sum())} tokens")
    return ids.astype(np.int32)


def load_speculators_drafter(folder: str | os.PathLike, target_cfg=None, *, dtype: Any = jnp.float32
                             ) -> tuple[Drafter, dict[str, Any]]:
    """Load a speculators DSpark or DFlash drafter folder (``save_pretrained`` of ``DSparkDraftModel`` /
    ``DFlashDraftModel``).

    Every field and every tensor's name and shape is checked (from the config and the safetensors headers)
    before any weight is read; then the draft vocabulary maps are read and checked, then the weights, tensor by
    tensor. The drafter shares the target's embedding and LM head.

    Args:
      folder: the checkpoint folder.
      target_cfg: optional `LlamaConfig` of the target: the drafter's width, vocabulary and tapped layers
        must fit it (`check_drafter_fits`).
      dtype: the parameters' dtype.
    Returns:
      (drafter, metadata): metadata holds ``format`` = ``"speculators"``, the ``source`` folder, the
      ``config`` dict as read and the ``verifier`` it names (or None).
    Raises:
      ValueError: naming the file, the field or tensor, and what was expected.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    hf = read_json_object(cfg_path, missing=f"expected a speculators checkpoint folder with config.json and "
                                            f"{WEIGHTS}")
    cfg = speculators_drafter_config(hf, cfg_path)
    if target_cfg is not None:
        check_drafter_fits(cfg, target_cfg, cfg_path, layer_field="aux_hidden_state_layer_ids", layer_offset=1)
    tensors = shared_tensor_map(cfg)
    vocab_ids = None
    if cfg.draft_vocab < cfg.vocab_size:
        files = weight_files(folder)
        if "lm_head.weight" in files:  # the target's rows (speculators' classes refill them when absent): checked only
            tensors["lm_head.weight"] = Tensor(None, (cfg.draft_vocab, cfg.dim))
        check_tensor_headers(folder, files, {**{n: t.shape for n, t in tensors.items()},
                                             "d2t": (cfg.draft_vocab,), "t2d": (cfg.vocab_size,)},
                             source=cfg_path, hint=HINT)
        vocab_ids = _vocab_ids(files, cfg, cfg_path)
    drafter = read_drafter(folder, cfg, tensors, source=cfg_path, dtype=dtype, hint=HINT, vocab_ids=vocab_ids)
    verifier = (hf.get("speculators_config") or {}).get("verifier") or {}
    return drafter, {"format": "speculators", "source": str(folder), "config": hf,
                     "verifier": verifier.get("name_or_path") if isinstance(verifier, dict) else None}


def speculators_refusals(cfg: DrafterConfig) -> list[str]:
    """What a speculators DSpark / DFlash folder cannot express of a drafter's config, one sentence each
    (empty: it can be written exactly).

    >>> cfg = DrafterConfig(vocab_size=64, dim=32, n_taps=2, n_heads=4, n_kv_heads=2, head_dim=8, tap_norm=True)
    >>> for reason in speculators_refusals(cfg):
    ...     print(reason.split("; ")[1])
    this drafter has qk_norm=False
    this drafter normalises each tap first (tap_norm=True)
    this drafter has a learned mask vector (mask_token=None)
    >>> speculators_refusals(DrafterConfig(vocab_size=64, dim=32, qk_norm=True, mask_token=63))
    []
    """
    out = []
    if not cfg.qk_norm:
        out.append("its Qwen3 layers normalise queries and keys; this drafter has qk_norm=False")
    if cfg.tap_norm:
        out.append("it projects the raw tapped layers; this drafter normalises each tap first (tap_norm=True)")
    if cfg.mask_token is None:
        out.append("it embeds the block slots as the target's embedding row mask_token_id and stores no embedding; "
                   "this drafter has a learned mask vector (mask_token=None)")
    if cfg.confidence and cfg.confidence_prev and cfg.head == "none":
        out.append("a confidence head reading W1 needs a Markov head (markov_rank > 0); this drafter has none")
    return out


def _check_own_copies(drafter: Drafter, emb: jax.Array, head: jax.Array) -> None:
    """A drafter with its own embedding and LM head copies (a DeepSpec import) is written sharing the target's:
    exact only if the copies are the target's."""
    ids = drafter.vocab_ids[...]
    for name, mine, target in (("embed_tokens.weight", drafter.embed[...], emb),
                               ("lm_head.weight", drafter.lm_head[...], head[:, ids])):
        diff = float(jnp.max(jnp.abs(mine.astype(jnp.float32) - target.astype(jnp.float32))))
        if diff != 0.0:
            raise ValueError(f"save_speculators_drafter: the drafter's own {name} differs from the target's (by up "
                             f"to {diff:.3g}); the format stores none and uses the target's, so it cannot be written "
                             f"exactly")


def save_speculators_drafter(drafter: Drafter, folder: str | os.PathLike, *, embed: jax.Array | None = None,
                             lm_head: jax.Array | None = None, verifier: str | None = None,
                             verifier_architectures: Sequence[str] = (),
                             target_layer_ids: Sequence[int] | None = None, dtype: Any = None,
                             attach: Sequence[str | os.PathLike] = ()) -> Path:
    """Write a drafter as a speculators folder (``config.json`` + ``model.safetensors``, the layout
    ``DSparkDraftModel.save_pretrained`` writes), atomically: ``speculators_model_type`` ``"dspark"`` with a
    Markov or confidence head, else ``"dflash"``; ``sample_from_anchor`` true.

    Args:
      drafter: the drafter; refused, naming the fields, where the format cannot express it
        (`speculators_refusals`).
      folder: the output folder (replaced if it exists).
      embed: [V, D] the target's embedding, and ``lm_head`` [D, V] its LM head (None: tied): needed for a
        reduced draft vocabulary (the format stores its LM head rows) and for a drafter with its own copies
        (checked to be the target's).
      verifier: the target's Hugging Face id or path, recorded as ``speculators_config.verifier.name_or_path``
        (speculators' classes rebuild the embedding from it); ``verifier_architectures`` likewise.
      target_layer_ids: our ids of the target layers it reads, when its config records none.
      dtype: the stored dtype (default: the parameters').
      attach: files copied beside the weights under their own names (``sts.json``, ``calibration.json``: the
        format has no place for them).
    Returns:
      the folder.
    Raises:
      ValueError: naming what the format cannot express or what is missing.
    """
    cfg = drafter.cfg
    taps = writable_taps(cfg, speculators_refusals(cfg), target_layer_ids, "save_speculators_drafter", "speculators")
    W, V = cfg.draft_vocab, cfg.vocab_size
    store = jnp.dtype(dtype or drafter.ctx_proj.kernel[...].dtype)
    tensors = file_tensors(drafter, shared_tensor_map(cfg), store)
    if cfg.own_embeddings or W < V:
        emb, head = target_embedding_and_head(cfg, embed, lm_head, "save_speculators_drafter")
        if cfg.own_embeddings:
            _check_own_copies(drafter, emb, head)
    if W < V:
        ids = np.asarray(drafter.vocab_ids[...], np.int64)
        tensors["lm_head.weight"] = np.asarray(head[:, ids].T.astype(store))  # [W, D]
        tensors["d2t"] = ids - np.arange(W, dtype=np.int64)
        tensors["t2d"] = np.zeros(V, bool)
        tensors["t2d"][ids] = True
    kind = "dspark" if cfg.sequential else "dflash"
    hf = {
        "architectures": [ARCHITECTURES[kind]], "speculators_model_type": kind,
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": {"model_type": "qwen3", **qwen3_config(cfg)},
        "draft_vocab_size": W, "block_size": cfg.block, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in taps], "mask_token_id": cfg.mask_token,
        "sliding_window_non_causal": False, "sample_from_anchor": True,
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
        "tie_word_embeddings": False, "dtype": str(store),
    }
    if kind == "dspark":
        hf.update(markov_rank=0 if cfg.head == "none" else cfg.rank,
                  markov_head_type={v: k for k, v in MARKOV_HEADS.items()}.get(cfg.head, "vanilla"),
                  enable_confidence_head=cfg.confidence,
                  confidence_head_with_markov=bool(cfg.confidence and cfg.confidence_prev))
    folder = Path(folder)
    write_checkpoint(folder, tensors, hf, attach)
    return folder

