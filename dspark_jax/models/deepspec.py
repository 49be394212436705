"""DeepSpec drafters (DFlash and DSpark, ``Qwen3DSparkModel``) in this project's `Drafter`, and back.

DeepSpec (DeepSeek, MIT) trains its drafters in PyTorch and writes them with ``save_pretrained``: a folder with a
``config.json`` (a Qwen3 config plus ``target_layer_ids``, ``block_size``, ``mask_token_id``, ``markov_rank``,
``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``) and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``). Its architecture is ours with switches on
(`DrafterConfig`): Qwen3 layers (``qk_norm``), the block slots embedded as the row ``mask_token_id`` of its own
embedding copy (``mask_token``, ``own_embeddings``), its own LM head copy, a vanilla/gated/RNN Markov head
(``head`` = ``markov``/``gated``/``rnn``; rank 0: none, a DFlash drafter) and a confidence head on
``[h ; W1[x_prev]]`` or on ``h`` alone (``confidence_prev``). A DFlash drafter is the same model with
``markov_rank = 0`` and no confidence head.

Tensor names (PyTorch ``Linear`` weights are [out, in]; ours are [in, out]):

==========================================  ===========================================
DeepSpec                                    ours
==========================================  ===========================================
``embed_tokens.weight`` [V, D]              ``embed`` [V, D]
``lm_head.weight`` [V, D]                   ``lm_head`` [D, V]
``fc.weight`` [D, M*D]                      ``ctx_proj/kernel`` [M*D, D]
``hidden_norm.weight``, ``norm.weight``     ``ctx_norm/scale``, ``final_norm/scale``
``layers.i.self_attn.{q,k,v,o}_proj``       ``layers/i/{wq,wk,wv,wo}/kernel``
``layers.i.self_attn.{q,k}_norm``           ``layers/i/{q,k}_norm/scale``
``layers.i.mlp.{gate,up,down}_proj``        ``layers/i/{w_gate,w_up,w_down}/kernel``
``layers.i.{input,post_attention}_layernorm``  ``layers/i/{attn,mlp}_norm/scale``
``markov_head.markov_w1.weight`` [V, r]     ``w1/embedding`` [V + 1, r] (row V unused)
``markov_head.markov_w2.weight`` [V, r]     ``w2/kernel`` [r, V]
``markov_head.gate_proj`` (gated)           ``gate``
``markov_head.joint_proj`` (rnn)            ``cell``
``confidence_head.proj``                    ``conf``
==========================================  ===========================================

Context features: DeepSpec taps ``hidden_states[i + 1]`` of the target for each ``i`` of ``target_layer_ids``,
the residual stream after decoder layer ``i``: what our target's ``tap_layers`` index. (``-1``, the embedding
output, has no tap here and is refused.)

Axis legend: V vocabulary, D width, M tapped layers, r Markov rank, E head dim.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.io import atomic_folder, read_json_object
from dspark_jax.models.drafter import Drafter, DrafterConfig

__all__ = ["MARKOV_HEADS", "is_deepspec_folder", "deepspec_drafter_config", "check_drafter_fits",
           "load_deepspec_drafter", "save_deepspec_drafter"]

# DeepSpec's markov_head_type -> our DrafterConfig.head
MARKOV_HEADS = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}
ARCHITECTURE = "Qwen3DSparkModel"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def is_deepspec_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a DeepSpec drafter: ``config.json`` with ``target_layer_ids`` and
    ``block_size``, and safetensors weights. Reads the config only."""
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file() or not ((path / WEIGHTS).is_file() or (path / INDEX).is_file()):
        return False
    try:
        hf = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(hf, dict) and "target_layer_ids" in hf and "block_size" in hf


def _field(hf: dict, name: str, source: Path, kind: type | tuple = int, default: Any = KeyError) -> Any:
    """``hf[name]`` checked to be of ``kind``; a ValueError naming the file and the field otherwise."""
    if name not in hf:
        if default is KeyError:
            raise ValueError(f"{source}: field {name!r} is missing (a DeepSpec drafter config needs it)")
        return default
    value = hf[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"{source}: field {name!r} = {value!r}, expected {kinds[0].__name__}")
    if not isinstance(value, kinds):
        raise ValueError(f"{source}: field {name!r} = {value!r}, expected {kinds[0].__name__}")
    return value


def _rope_theta(hf: dict, source: Path) -> float:
    """RoPE base from ``rope_theta`` or ``rope_parameters``; only plain (unscaled) RoPE is supported."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for name, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = d.get("rope_type", d.get("type", "default")) if isinstance(d, dict) else d
        if kind not in (None, "default"):
            raise ValueError(f"{source}: field {name!r} asks for RoPE type {kind!r}; only the default "
                             f"(unscaled) RoPE is supported")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"{source}: field 'rope_theta' (or rope_parameters.rope_theta) = {theta!r}, "
                         f"expected a positive number")
    return float(theta)


def deepspec_drafter_config(hf: dict, source: str | os.PathLike = "config.json") -> DrafterConfig:
    """Our `DrafterConfig` for a DeepSpec ``config.json`` (parsed), with every field checked.

    Args:
      hf: the parsed config.
      source: the file's path, for error messages.
    Returns:
      the config (``qk_norm``, ``own_embeddings``, ``mask_token`` and ``tap_layers`` set).
    Raises:
      ValueError: naming the file, the field and what was expected.

    >>> hf = dict(hidden_size=32, vocab_size=64, num_hidden_layers=1, num_attention_heads=4,
    ...           num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e6,
    ...           target_layer_ids=[0, 1], block_size=4, mask_token_id=63, markov_rank=8,
    ...           markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True)
    >>> c = deepspec_drafter_config(hf)
    >>> c.head, c.n_taps, c.tap_layers, c.mask_token, c.qk_norm, c.own_embeddings
    ('markov', 2, (0, 1), 63, True, True)
    """
    src = Path(source)
    if not isinstance(hf, dict):
        raise ValueError(f"{src}: expected a JSON object")
    archs = hf.get("architectures")
    if archs is not None and ARCHITECTURE not in archs:
        raise ValueError(f"{src}: field 'architectures' = {archs!r}, expected [{ARCHITECTURE!r}] (only DeepSpec's "
                         f"Qwen3 drafters are supported)")
    dim = _field(hf, "hidden_size", src)
    vocab = _field(hf, "vocab_size", src)
    n_heads = _field(hf, "num_attention_heads", src)
    n_kv = _field(hf, "num_key_value_heads", src, default=n_heads)
    head_dim = _field(hf, "head_dim", src, default=None) if hf.get("head_dim") is not None else dim // n_heads
    if _field(hf, "attention_bias", src, bool, default=False):
        raise ValueError(f"{src}: field 'attention_bias' = true; DeepSpec's Qwen3 drafters have none and "
                         f"this loader supports none")
    act = _field(hf, "hidden_act", src, str, default="silu")
    if act != "silu":
        raise ValueError(f"{src}: field 'hidden_act' = {act!r}, expected 'silu'")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or hf.get("use_sliding_window"):
        raise ValueError(f"{src}: field 'layer_types' = {layer_types!r}: only full attention is supported")
    taps = _field(hf, "target_layer_ids", src, list)
    if not taps or not all(isinstance(i, int) and not isinstance(i, bool) for i in taps):
        raise ValueError(f"{src}: field 'target_layer_ids' = {taps!r}, expected a non-empty list of layer ids")
    if any(i < 0 for i in taps):
        raise ValueError(f"{src}: field 'target_layer_ids' = {taps!r}: -1 (the target's embedding output) is "
                         f"not a layer this engine's target can tap; expected ids >= 0")
    if any(b <= a for a, b in zip(taps, taps[1:])):
        raise ValueError(f"{src}: field 'target_layer_ids' = {taps!r}, expected strictly increasing ids")
    rank = _field(hf, "markov_rank", src)
    if rank < 0:
        raise ValueError(f"{src}: field 'markov_rank' = {rank}, expected >= 0 (0: no Markov head)")
    head = "none"
    if rank > 0:
        kind = str(_field(hf, "markov_head_type", src, str)).lower()
        if kind not in MARKOV_HEADS:
            raise ValueError(f"{src}: field 'markov_head_type' = {kind!r}, expected one of {sorted(MARKOV_HEADS)}")
        head = MARKOV_HEADS[kind]
    confidence = _field(hf, "enable_confidence_head", src, bool)
    with_markov = bool(_field(hf, "confidence_head_with_markov", src, bool)) if confidence else False
    if with_markov and rank == 0:
        raise ValueError(f"{src}: field 'confidence_head_with_markov' = true needs markov_rank > 0")
    mask = _field(hf, "mask_token_id", src)
    if not 0 <= mask < vocab:
        raise ValueError(f"{src}: field 'mask_token_id' = {mask}, expected a token id in [0, {vocab})")
    try:
        return DrafterConfig(
            vocab_size=vocab, dim=dim, n_taps=len(taps), n_layers=_field(hf, "num_hidden_layers", src),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=_field(hf, "intermediate_size", src),
            block=_field(hf, "block_size", src), head=head, rank=max(rank, 1), confidence=bool(confidence),
            rope_base=_rope_theta(hf, src), norm_eps=float(_field(hf, "rms_norm_eps", src, (float, int))),
            qk_norm=True, mask_token=mask, own_embeddings=True, confidence_prev=with_markov, tap_layers=tuple(taps))
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from err


def check_drafter_fits(cfg: DrafterConfig, target_cfg, source: str | os.PathLike, *,
                       num_target_layers: int | None = None) -> None:
    """Raise a ValueError naming ``source``, the field and what the target expects when a drafter's width,
    vocabulary or tapped layers do not fit the target (a `LlamaConfig`).

    ``tap_layers`` must be layers of the target, below its last one; they need not equal the target's own
    ``tap_layers`` (the engine taps what the drafter reads, `dspark_jax.build`). Without ``tap_layers`` the
    drafter reads the target's taps, so their number must match.
    """
    src = str(source)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{src}: vocab_size = {cfg.vocab_size}, but the target's vocabulary has "
                         f"{target_cfg.vocab_size} tokens")
    if cfg.dim != target_cfg.dim:
        raise ValueError(f"{src}: hidden_size = {cfg.dim}, but the target's width (hidden_size) is {target_cfg.dim}")
    if num_target_layers is not None and num_target_layers != target_cfg.n_layers:
        raise ValueError(f"{src}: num_target_layers = {num_target_layers}, but the target has "
                         f"{target_cfg.n_layers} layers")
    if cfg.tap_layers is None:
        if cfg.n_taps != len(target_cfg.tap_layers):
            raise ValueError(f"{src}: the drafter reads {cfg.n_taps} tapped layers, but the target taps "
                             f"{len(target_cfg.tap_layers)} ({target_cfg.tap_layers})")
        return
    # DeepSpec's feature for the final layer would be Hugging Face's last hidden state, after the final norm,
    # where our tap is the residual stream before it: the final layer is refused (as DeepSpec's evaluator does).
    top = target_cfg.n_layers - 1 if target_cfg.n_layers > 1 else 1
    bad = [i for i in cfg.tap_layers if not 0 <= i < top]
    if bad:
        raise ValueError(f"{src}: target_layer_ids = {list(cfg.tap_layers)} holds {bad}, but the target has "
                         f"{target_cfg.n_layers} layers: expected ids in [0, {top}) (never the final layer)")


# ------------------------------------------------------------------------------------------------------------
# Tensor map


def _t(x):
    return x.T


def _tensor_map(cfg: DrafterConfig) -> dict[str, tuple[tuple, tuple[int, ...], Callable | None]]:
    """DeepSpec tensor name -> (our state path, DeepSpec shape, transform DeepSpec -> ours or None)."""
    D, V, r, E = cfg.dim, cfg.vocab_size, cfg.rank, cfg.head_dim
    H, K, F, M = cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.n_taps
    out = {
        "embed_tokens.weight": (("embed",), (V, D), None),
        "lm_head.weight": (("lm_head",), (V, D), _t),
        "fc.weight": (("ctx_proj", "kernel"), (D, M * D), _t),
        "hidden_norm.weight": (("ctx_norm", "scale"), (D,), None),
        "norm.weight": (("final_norm", "scale"), (D,), None),
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (("layers", i, "wq", "kernel"), (H * E, D), _t),
            p + "self_attn.k_proj.weight": (("layers", i, "wk", "kernel"), (K * E, D), _t),
            p + "self_attn.v_proj.weight": (("layers", i, "wv", "kernel"), (K * E, D), _t),
            p + "self_attn.o_proj.weight": (("layers", i, "wo", "kernel"), (D, H * E), _t),
            p + "self_attn.q_norm.weight": (("layers", i, "q_norm", "scale"), (E,), None),
            p + "self_attn.k_norm.weight": (("layers", i, "k_norm", "scale"), (E,), None),
            p + "mlp.gate_proj.weight": (("layers", i, "w_gate", "kernel"), (F, D), _t),
            p + "mlp.up_proj.weight": (("layers", i, "w_up", "kernel"), (F, D), _t),
            p + "mlp.down_proj.weight": (("layers", i, "w_down", "kernel"), (D, F), _t),
            p + "input_layernorm.weight": (("layers", i, "attn_norm", "scale"), (D,), None),
            p + "post_attention_layernorm.weight": (("layers", i, "mlp_norm", "scale"), (D,), None),
        })
    if cfg.uses_prev_token:  # our table has one more row (tokens outside a reduced draft vocabulary): zeros
        out["markov_head.markov_w1.weight"] = (("w1", "embedding"), (V, r),
                                               lambda w: jnp.concatenate([w, jnp.zeros((1, w.shape[1]), w.dtype)]))
    if cfg.head != "none":
        out["markov_head.markov_w2.weight"] = (("w2", "kernel"), (V, r), _t)
    if cfg.head == "gated":
        out["markov_head.gate_proj.weight"] = (("gate", "kernel"), (r, D + r), _t)
        out["markov_head.gate_proj.bias"] = (("gate", "bias"), (r,), None)
    if cfg.head == "rnn":
        out["markov_head.joint_proj.weight"] = (("cell", "kernel"), (3 * r, 2 * r + D), _t)
        out["markov_head.joint_proj.bias"] = (("cell", "bias"), (3 * r,), None)
    if cfg.confidence:
        width = D + r if cfg.confidence_prev else D
        out["confidence_head.proj.weight"] = (("conf", "kernel"), (1, width), _t)
        out["confidence_head.proj.bias"] = (("conf", "bias"), (1,), None)
    return out


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or shards listed in the index)."""
    from safetensors import safe_open  # noqa: PLC0415

    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index}: expected a JSON object with a 'weight_map'") from err
        files = {name: folder / shard for name, shard in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise ValueError(f"{index} names shards that are missing: {missing[:3]}")
        return files
    path = folder / WEIGHTS
    if not path.is_file():
        raise ValueError(f"{folder}: expected {WEIGHTS} (or {INDEX} with its shards)")
    with safe_open(str(path), framework="flax") as f:
        return {name: path for name in f.keys()}


def load_deepspec_drafter(folder: str | os.PathLike, target_cfg=None, *, dtype: Any = jnp.float32
                          ) -> tuple[Drafter, dict[str, Any]]:
    """Load a DeepSpec DFlash or DSpark drafter folder (``save_pretrained`` of ``Qwen3DSparkModel``).

    Every field and every tensor's name and shape is checked (from the config and the safetensors headers)
    before any weight is read; the weights are then read tensor by tensor.

    Args:
      folder: the checkpoint folder.
      target_cfg: optional `LlamaConfig` of the target: the drafter's width, vocabulary and tapped layers
        must fit it (`check_drafter_fits`).
      dtype: the parameters' dtype.
    Returns:
      (drafter, metadata): metadata holds ``format`` = ``"deepspec"``, the ``source`` folder and the
      ``config`` dict as read.
    Raises:
      ValueError: naming the file, the field or tensor, and what was expected.
    """
    from safetensors import safe_open  # noqa: PLC0415

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder}: expected a DeepSpec drafter folder with config.json and {WEIGHTS}")
    hf = read_json_object(cfg_path)
    cfg = deepspec_drafter_config(hf, cfg_path)
    if target_cfg is not None:
        check_drafter_fits(cfg, target_cfg, cfg_path, num_target_layers=hf.get("num_target_layers"))
    tensors = _tensor_map(cfg)
    files = _weight_files(folder)
    missing = [name for name in tensors if name not in files]
    if missing:
        raise ValueError(f"{folder}: the weights lack {missing[:5]} (config.json and the weights disagree: "
                         f"markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov, "
                         f"num_hidden_layers)")
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="flax"))
                   for path in sorted(set(files[n] for n in tensors))}
        for name, (_, shape, _) in tensors.items():
            have = tuple(handles[files[name]].get_slice(name).get_shape())
            if have != shape:
                raise ValueError(f"{files[name]}: tensor {name!r} has shape {list(have)}, expected {list(shape)} "
                                 f"(from {cfg_path})")
        abstract = nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        flat = dict(nnx.to_flat_state(state))
        values = {}
        for name, (path, _, fn) in tensors.items():
            arr = handles[files[name]].get_tensor(name)
            values[path] = (fn(arr) if fn is not None else arr).astype(dtype)
    ids = jnp.arange(cfg.vocab_size, dtype=jnp.int32)
    values[("vocab_ids",)] = ids
    values[("to_draft",)] = ids
    unset = [p for p in flat if p not in values]
    if unset:  # a bug in the map, not in the file
        raise AssertionError(f"tensor map leaves {unset} unset")
    for path, var in flat.items():
        var.set_value(values[path])
    state = nnx.from_flat_state(flat)
    drafter = nnx.merge(graphdef, state)
    meta = {"format": "deepspec", "source": str(folder), "config": hf}
    return drafter, meta


def save_deepspec_drafter(drafter: Drafter, folder: str | os.PathLike, *, embed: jax.Array | None = None,
                          lm_head: jax.Array | None = None, mask_token_id: int | None = None,
                          target_layer_ids: tuple[int, ...] | None = None, num_target_layers: int | None = None,
                          dtype: Any = None) -> Path:
    """Write a drafter as a DeepSpec ``Qwen3DSparkModel`` folder (``config.json`` + ``model.safetensors``),
    atomically, where the architectures allow it.

    DeepSpec's layers always normalise queries and keys (``qk_norm``) and propose from the full vocabulary, so
    a drafter without QK-norm or with a reduced draft vocabulary cannot be written exactly and is refused.

    Args:
      drafter: the drafter.
      folder: the output folder (replaced if it exists).
      embed: [V, D] the target embedding, for a drafter that shares the target's (``own_embeddings`` False).
      lm_head: [D, V] the target LM head (None with ``embed``: tied, ``embed.T``).
      mask_token_id: for a drafter with a learned mask vector: the row of the written embedding that takes it
        (exact only if that token is never an anchor, i.e. never emitted: pick an unused row).
      target_layer_ids: the target layers it reads, when its config does not record them.
      num_target_layers: recorded in the config when given.
      dtype: the stored dtype (default: the parameters').
    Returns:
      the folder.
    Raises:
      ValueError: naming what the architectures cannot express.
    """
    from safetensors.flax import save_file  # noqa: PLC0415

    cfg = drafter.cfg
    folder = Path(folder)
    if not cfg.qk_norm:
        raise ValueError("save_deepspec_drafter: DeepSpec's Qwen3 layers normalise queries and keys; this drafter "
                         "has qk_norm=False, which they cannot express")
    if cfg.tap_norm:
        raise ValueError("save_deepspec_drafter: DeepSpec drafters project the raw tapped layers; this drafter "
                         "normalises each tap first (tap_norm=True), which they cannot express")
    if cfg.draft_vocab != cfg.vocab_size:
        raise ValueError(f"save_deepspec_drafter: DeepSpec drafters propose from the full vocabulary; this drafter "
                         f"has a reduced draft vocabulary of {cfg.draft_vocab} of {cfg.vocab_size} tokens")
    taps = cfg.tap_layers if target_layer_ids is None else tuple(int(i) for i in target_layer_ids)
    if taps is None or len(taps) != cfg.n_taps:
        raise ValueError(f"save_deepspec_drafter: target_layer_ids: expected the {cfg.n_taps} target layers the "
                         f"drafter reads (its config records none)")
    if cfg.own_embeddings:
        emb, head = drafter.embed[...], drafter.lm_head[...]
    else:
        if embed is None:
            raise ValueError("save_deepspec_drafter: the drafter shares the target's embedding and LM head; pass "
                             "embed= (and lm_head= unless tied)")
        emb, head = jnp.asarray(embed), jnp.asarray(embed).T if lm_head is None else jnp.asarray(lm_head)
    if emb.shape != (cfg.vocab_size, cfg.dim) or head.shape != (cfg.dim, cfg.vocab_size):
        raise ValueError(f"save_deepspec_drafter: embed {emb.shape} / lm_head {head.shape}: expected "
                         f"({cfg.vocab_size}, {cfg.dim}) / ({cfg.dim}, {cfg.vocab_size})")
    mask = cfg.mask_token
    if mask is None:
        if mask_token_id is None or not 0 <= int(mask_token_id) < cfg.vocab_size:
            raise ValueError(f"save_deepspec_drafter: the drafter has a learned mask vector; mask_token_id: "
                             f"expected an unused token id in [0, {cfg.vocab_size}) to hold it, got {mask_token_id!r}")
        mask = int(mask_token_id)
        emb = emb.at[mask].set(drafter.mask_embed[...].astype(emb.dtype))
    flat = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(drafter))}
    tensors = {}
    for name, (path, shape, fn) in _tensor_map(cfg).items():
        if path == ("embed",):
            arr = emb
        elif path == ("lm_head",):
            arr = head.T
        elif path == ("w1", "embedding"):
            arr = flat[path][: cfg.vocab_size]
        else:
            arr = flat[path]
            arr = arr.T if fn is _t else arr
        assert tuple(arr.shape) == shape, (name, arr.shape, shape)
        tensors[name] = jnp.asarray(arr, dtype or arr.dtype)
    store = jnp.dtype(dtype or flat[("ctx_proj", "kernel")].dtype)
    hf = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base, "rope_parameters": {"rope_theta": cfg.rope_base, "rope_type": "default"},
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "layer_types": ["full_attention"] * cfg.n_layers, "use_sliding_window": False, "sliding_window": None,
        "block_size": cfg.block, "mask_token_id": mask, "target_layer_ids": list(taps), "num_anchors": 512,
        "markov_rank": 0 if cfg.head == "none" else cfg.rank,
        "enable_confidence_head": cfg.confidence, "dtype": str(store), "torch_dtype": str(store),
    }
    if cfg.head != "none":
        hf["markov_head_type"] = {v: k for k, v in MARKOV_HEADS.items()}[cfg.head]
    if cfg.confidence:
        hf["confidence_head_with_markov"] = cfg.confidence_prev
        if cfg.confidence_prev and cfg.head == "none":
            raise ValueError("save_deepspec_drafter: a confidence head reading W1 needs a Markov head in DeepSpec "
                             "(markov_rank > 0); this drafter has none")
    if num_target_layers is not None:
        hf["num_target_layers"] = int(num_target_layers)
    with atomic_folder(folder) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return folder
