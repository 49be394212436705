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
import shutil
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
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


def config_field(hf: dict, name: str, source: Path, kind: type | tuple = int, default: Any = KeyError, *,
                 prefix: str = "") -> Any:
    """``hf[name]`` checked to be of ``kind``; a ValueError naming the file and the field (``prefix + name``, the
    field's place in a nested config) otherwise. Without ``default`` the field is required."""
    if name not in hf:
        if default is KeyError:
            raise ValueError(f"{source}: field '{prefix}{name}' is missing (the drafter config needs it)")
        return default
    value = hf[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"{source}: field '{prefix}{name}' = {value!r}, expected {kinds[0].__name__}")
    if not isinstance(value, kinds):
        raise ValueError(f"{source}: field '{prefix}{name}' = {value!r}, expected {kinds[0].__name__}")
    return value



def _rope_theta(hf: dict, source: Path, prefix: str = "") -> float:
    """RoPE base from ``rope_theta`` or ``rope_parameters``; only plain (unscaled) RoPE is supported."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for name, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = d.get("rope_type", d.get("type", "default")) if isinstance(d, dict) else d
        if kind not in (None, "default"):
            raise ValueError(f"{source}: field '{prefix}{name}' asks for RoPE type {kind!r}; only the default "
                             f"(unscaled) RoPE is supported")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"{source}: field '{prefix}rope_theta' (or rope_parameters.rope_theta) = {theta!r}, "
                         f"expected a positive number")
    return float(theta)


def qwen3_layer_fields(hf: dict, source: Path, prefix: str = "") -> dict[str, Any]:
    """The `DrafterConfig` fields of a Qwen3 decoder-layer config (DeepSpec's whole config, or speculators'
    ``transformer_layer_config``): width, vocabulary, heads, MLP, RoPE and norm, each checked; bias, another
    activation than SiLU and sliding-window layers are refused. ``prefix`` names the nested place in messages."""
    dim = config_field(hf, "hidden_size", source, prefix=prefix)
    n_heads = config_field(hf, "num_attention_heads", source, prefix=prefix)
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        head_dim = config_field(hf, "head_dim", source, prefix=prefix)
    if config_field(hf, "attention_bias", source, bool, default=False, prefix=prefix):
        raise ValueError(f"{source}: field '{prefix}attention_bias' = true; Qwen3 drafter layers have none and "
                         f"this loader supports none")
    act = config_field(hf, "hidden_act", source, str, default="silu", prefix=prefix)
    if act != "silu":
        raise ValueError(f"{source}: field '{prefix}hidden_act' = {act!r}, expected 'silu'")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or hf.get("use_sliding_window"):
        raise ValueError(f"{source}: field '{prefix}layer_types' = {layer_types!r}: only full attention is supported")
    return dict(dim=dim, vocab_size=config_field(hf, "vocab_size", source, prefix=prefix), n_heads=n_heads,
                n_kv_heads=config_field(hf, "num_key_value_heads", source, default=n_heads, prefix=prefix),
                head_dim=dim // n_heads if head_dim is None else head_dim,
                n_layers=config_field(hf, "num_hidden_layers", source, prefix=prefix),
                ffn_dim=config_field(hf, "intermediate_size", source, prefix=prefix),
                rope_base=_rope_theta(hf, source, prefix),
                norm_eps=float(config_field(hf, "rms_norm_eps", source, (float, int), prefix=prefix)))


def check_layer_ids(ids: Any, source: Path, name: str, lowest: int, meaning: str) -> tuple[int, ...]:
    """A config's list of tapped target layers: a non-empty, strictly increasing list of ints >= ``lowest``
    (``meaning`` says what the id below it would tap)."""
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{source}: field '{name}' = {ids!r}, expected a non-empty list of layer ids")
    if any(i < lowest for i in ids):
        raise ValueError(f"{source}: field '{name}' = {ids!r}: {lowest - 1} ({meaning}) is not a layer this "
                         f"engine's target can tap; expected ids >= {lowest}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{source}: field '{name}' = {ids!r}, expected strictly increasing ids")
    return tuple(ids)


def sequential_head_fields(hf: dict, source: Path) -> dict[str, Any]:
    """`DrafterConfig` fields ``head``, ``rank``, ``confidence``, ``confidence_prev`` from the Markov and
    confidence head fields DeepSpec and speculators share (``markov_rank`` 0: no Markov head)."""
    rank = config_field(hf, "markov_rank", source)
    if rank < 0:
        raise ValueError(f"{source}: field 'markov_rank' = {rank}, expected >= 0 (0: no Markov head)")
    head = "none"
    if rank > 0:
        kind = str(config_field(hf, "markov_head_type", source, str)).lower()
        if kind not in MARKOV_HEADS:
            raise ValueError(f"{source}: field 'markov_head_type' = {kind!r}, expected one of "
                             f"{sorted(MARKOV_HEADS)}")
        head = MARKOV_HEADS[kind]
    confidence = config_field(hf, "enable_confidence_head", source, bool)
    with_markov = bool(config_field(hf, "confidence_head_with_markov", source, bool)) if confidence else False
    if with_markov and rank == 0:
        raise ValueError(f"{source}: field 'confidence_head_with_markov' = true needs markov_rank > 0")
    return dict(head=head, rank=max(rank, 1), confidence=bool(confidence), confidence_prev=with_markov)


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
    layers = qwen3_layer_fields(hf, src)
    taps = check_layer_ids(config_field(hf, "target_layer_ids", src, list), src, "target_layer_ids", 0,
                           "the target's embedding output")
    heads = sequential_head_fields(hf, src)
    mask = config_field(hf, "mask_token_id", src)
    if not 0 <= mask < layers["vocab_size"]:
        raise ValueError(f"{src}: field 'mask_token_id' = {mask}, expected a token id in [0, {layers['vocab_size']})")
    try:
        return DrafterConfig(**layers, **heads, n_taps=len(taps), block=config_field(hf, "block_size", src),
                             qk_norm=True, mask_token=mask, own_embeddings=True, tap_layers=taps)
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from err


def check_drafter_fits(cfg: DrafterConfig, target_cfg, source: str | os.PathLike, *,
                       num_target_layers: int | None = None, layer_field: str = "target_layer_ids",
                       layer_offset: int = 0) -> None:
    """Raise a ValueError naming ``source``, the field and what the target expects when a drafter's width,
    vocabulary or tapped layers do not fit the target (a `LlamaConfig`).

    ``tap_layers`` must be layers of the target, below its last one; they need not equal the target's own
    ``tap_layers`` (the engine taps what the drafter reads, `dspark_jax.build`). Without ``tap_layers`` the
    drafter reads the target's taps, so their number must match. Messages name the file's own field for them,
    ``layer_field``, whose ids are ours plus ``layer_offset``.
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
    bad = [i + layer_offset for i in cfg.tap_layers if not 0 <= i < top]
    if bad:
        ids = [i + layer_offset for i in cfg.tap_layers]
        raise ValueError(f"{src}: {layer_field} = {ids} holds {bad}, but the target has {target_cfg.n_layers} "
                         f"layers: expected ids in [{layer_offset}, {top + layer_offset}) (never the final layer)")


# ------------------------------------------------------------------------------------------------------------
# Tensor map


class Tensor(NamedTuple):
    """A checkpoint tensor: our state path (None: checked, not read), its shape in the file, and whether the file
    holds it transposed (PyTorch ``Linear`` weights are [out, in]; ours are [in, out])."""

    path: tuple | None
    shape: tuple[int, ...]
    transposed: bool = False


W1 = "markov_head.markov_w1.weight"


def shared_tensor_map(cfg: DrafterConfig) -> dict[str, Tensor]:
    """The tensors DeepSpec's and vLLM speculators' DFlash / DSpark checkpoints name alike: the context projection
    and norm, the draft layers, the final norm, the Markov head (``markov_w1`` [V, r], a row per target token;
    ``markov_w2`` over the draft vocabulary) and the confidence head. The embedding and LM head are each
    format's own."""
    D, V, W, r, E = cfg.dim, cfg.vocab_size, cfg.draft_vocab, cfg.rank, cfg.head_dim
    H, K, F, M = cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.n_taps
    out = {
        "fc.weight": Tensor(("ctx_proj", "kernel"), (D, M * D), True),
        "hidden_norm.weight": Tensor(("ctx_norm", "scale"), (D,)),
        "norm.weight": Tensor(("final_norm", "scale"), (D,)),
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": Tensor(("layers", i, "wq", "kernel"), (H * E, D), True),
            p + "self_attn.k_proj.weight": Tensor(("layers", i, "wk", "kernel"), (K * E, D), True),
            p + "self_attn.v_proj.weight": Tensor(("layers", i, "wv", "kernel"), (K * E, D), True),
            p + "self_attn.o_proj.weight": Tensor(("layers", i, "wo", "kernel"), (D, H * E), True),
            p + "self_attn.q_norm.weight": Tensor(("layers", i, "q_norm", "scale"), (E,)),
            p + "self_attn.k_norm.weight": Tensor(("layers", i, "k_norm", "scale"), (E,)),
            p + "mlp.gate_proj.weight": Tensor(("layers", i, "w_gate", "kernel"), (F, D), True),
            p + "mlp.up_proj.weight": Tensor(("layers", i, "w_up", "kernel"), (F, D), True),
            p + "mlp.down_proj.weight": Tensor(("layers", i, "w_down", "kernel"), (D, F), True),
            p + "input_layernorm.weight": Tensor(("layers", i, "attn_norm", "scale"), (D,)),
            p + "post_attention_layernorm.weight": Tensor(("layers", i, "mlp_norm", "scale"), (D,)),
        })
    if cfg.uses_prev_token:
        out[W1] = Tensor(("w1", "embedding"), (V, r))  # ours: [W + 1, r], see w1_from_file
    if cfg.head != "none":
        out["markov_head.markov_w2.weight"] = Tensor(("w2", "kernel"), (W, r), True)
    if cfg.head == "gated":
        out["markov_head.gate_proj.weight"] = Tensor(("gate", "kernel"), (r, D + r), True)
        out["markov_head.gate_proj.bias"] = Tensor(("gate", "bias"), (r,))
    if cfg.head == "rnn":
        out["markov_head.joint_proj.weight"] = Tensor(("cell", "kernel"), (3 * r, 2 * r + D), True)
        out["markov_head.joint_proj.bias"] = Tensor(("cell", "bias"), (3 * r,))
    if cfg.confidence:
        width = D + r if cfg.confidence_prev else D
        out["confidence_head.proj.weight"] = Tensor(("conf", "kernel"), (1, width), True)
        out["confidence_head.proj.bias"] = Tensor(("conf", "bias"), (1,))
    return out


def _deepspec_tensor_map(cfg: DrafterConfig) -> dict[str, Tensor]:
    """DeepSpec's tensors: the shared ones and the drafter's own embedding and LM head copies."""
    V, D = cfg.vocab_size, cfg.dim
    return {"embed_tokens.weight": Tensor(("embed",), (V, D)), "lm_head.weight": Tensor(("lm_head",), (V, D), True),
            **shared_tensor_map(cfg)}


def w1_from_file(w: jax.Array, vocab_ids: np.ndarray, source: str) -> jax.Array:
    """W1 as checkpoints hold it, [V, r] (a row per target token), as ours, [W + 1, r]: the draft vocabulary's
    rows, then the one row every token outside it shares (zeros when there is none).

    Raises:
      ValueError: naming ``source`` when tokens outside the draft vocabulary have different rows, which our
        table cannot hold.
    """
    inside = np.zeros(w.shape[0], bool)
    inside[vocab_ids] = True
    if inside.all():
        return jnp.concatenate([w, jnp.zeros((1, w.shape[1]), w.dtype)])
    outside = w[np.flatnonzero(~inside)]
    if not bool(jnp.all(outside == outside[:1])):
        raise ValueError(f"{source}: the rows of the {int((~inside).sum())} tokens outside the draft vocabulary "
                         f"differ; this engine's Markov table keeps one row for all of them, so the drafter cannot "
                         f"be read exactly")
    return jnp.concatenate([w[vocab_ids], outside[:1]])


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (``model.safetensors``, or shards listed in the index)."""
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


def check_tensor_headers(folder: Path, files: dict[str, Path], shapes: dict[str, tuple[int, ...]], *,
                         source: Path, hint: str) -> None:
    """Check, from the safetensors headers alone, that every tensor named in ``shapes`` is in ``files``
    (`weight_files`) with that shape. Raises a ValueError naming the folder or file, the tensor and the shape
    expected (``hint``: which config fields decide which tensors exist)."""
    from safetensors import safe_open  # noqa: PLC0415

    missing = [name for name in shapes if name not in files]
    if missing:
        raise ValueError(f"{folder}: the weights lack {missing[:5]} (config.json and the weights disagree: {hint})")
    for path in sorted({files[n] for n in shapes}, key=str):
        with safe_open(str(path), framework="flax") as f:
            for name in (n for n in shapes if files[n] == path):
                have = tuple(f.get_slice(name).get_shape())
                if have != tuple(shapes[name]):
                    raise ValueError(f"{path}: tensor {name!r} has shape {list(have)}, expected "
                                     f"{list(shapes[name])} (from {source})")


def read_drafter(folder: Path, cfg: DrafterConfig, tensors: dict[str, Tensor], *, source: Path, dtype: Any,
                 hint: str, vocab_ids: np.ndarray | None = None) -> Drafter:
    """A `Drafter` of ``cfg`` with its parameters read from a safetensors checkpoint folder, tensor by tensor,
    after every tensor's name and shape was checked from the headers (`check_tensor_headers`).

    Args:
      folder: the checkpoint folder; cfg: the drafter's config.
      tensors: file name -> `Tensor`: every parameter of the drafter but the draft vocabulary maps.
      source: the config file, for messages; dtype: the parameters' dtype; hint: for a missing tensor.
      vocab_ids: [W] the draft vocabulary's token ids (default: the whole vocabulary).
    Returns:
      the drafter.
    """
    from safetensors import safe_open  # noqa: PLC0415

    files = weight_files(folder)
    check_tensor_headers(folder, files, {n: t.shape for n, t in tensors.items()}, source=source, hint=hint)
    ids = np.arange(cfg.vocab_size, dtype=np.int32) if vocab_ids is None else np.asarray(vocab_ids, np.int32)
    abstract = nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0), vocab_ids=ids))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    values = {}
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="flax"))
                   for path in sorted({files[n] for n in tensors}, key=str)}
        for name, t in tensors.items():
            if t.path is None:
                continue
            arr = handles[files[name]].get_tensor(name)
            if name == W1:
                arr = w1_from_file(arr, ids, f"{files[name]}: tensor {name!r}")
            elif t.transposed:
                arr = arr.T
            values[t.path] = arr.astype(dtype)
    to_draft = np.full(cfg.vocab_size, len(ids), np.int32)  # W: "not in the draft vocabulary"
    to_draft[ids] = np.arange(len(ids), dtype=np.int32)
    values[("vocab_ids",)] = jnp.asarray(ids)
    values[("to_draft",)] = jnp.asarray(to_draft)
    unset = [p for p in flat if p not in values]
    if unset:  # a bug in the map, not in the file
        raise AssertionError(f"tensor map leaves {unset} unset")
    for path, var in flat.items():
        var.set_value(values[path])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def file_tensors(drafter: Drafter, tensors: dict[str, Tensor], dtype: Any = None) -> dict[str, np.ndarray]:
    """The drafter's parameters under a checkpoint's names and layouts (``tensors``, every path ours): the
    inverse of `read_drafter`, as NumPy arrays in ``dtype`` (default: the parameters')."""
    flat = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(drafter))}
    out = {}
    for name, t in tensors.items():
        arr = flat[t.path]
        if name == W1:  # ours [W + 1, r] -> a row per target token
            arr = arr[drafter.to_draft[...]]
        elif t.transposed:
            arr = arr.T
        assert tuple(arr.shape) == t.shape, (name, arr.shape, t.shape)
        out[name] = np.asarray(jnp.asarray(arr, dtype or arr.dtype))
    return out


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
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder}: expected a DeepSpec drafter folder with config.json and {WEIGHTS}")
    hf = read_json_object(cfg_path)
    cfg = deepspec_drafter_config(hf, cfg_path)
    if target_cfg is not None:
        check_drafter_fits(cfg, target_cfg, cfg_path, num_target_layers=hf.get("num_target_layers"))
    drafter = read_drafter(folder, cfg, _deepspec_tensor_map(cfg), source=cfg_path, dtype=dtype,
                           hint="markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov, "
                                "num_hidden_layers")
    return drafter, {"format": "deepspec", "source": str(folder), "config": hf}


def writable_taps(cfg: DrafterConfig, refusals: list[str], target_layer_ids, who: str, fmt: str) -> tuple[int, ...]:
    """The target layers a drafter written by ``who`` records (``target_layer_ids`` or its config's), after
    raising ValueError with every one of ``refusals`` (what format ``fmt`` cannot hold)."""
    if refusals:
        raise ValueError(f"{who}: the {fmt} format cannot hold this drafter:" + "".join(f"\n  - {r}" for r in refusals))
    taps = cfg.tap_layers if target_layer_ids is None else tuple(int(i) for i in target_layer_ids)
    if taps is None or len(taps) != cfg.n_taps:
        raise ValueError(f"{who}: target_layer_ids: expected the {cfg.n_taps} target layers the drafter reads "
                         f"(its config records none)")
    return taps


def deepspec_refusals(cfg: DrafterConfig, *, mask_token_id: int | None = None) -> list[str]:
    """What a DeepSpec ``Qwen3DSparkModel`` folder cannot express of a drafter's config, one sentence each
    (empty: it can be written exactly)."""
    out = []
    if not cfg.qk_norm:
        out.append("DeepSpec's Qwen3 layers normalise queries and keys; this drafter has qk_norm=False")
    if cfg.tap_norm:
        out.append("DeepSpec drafters project the raw tapped layers; this drafter normalises each tap first "
                   "(tap_norm=True)")
    if cfg.draft_vocab != cfg.vocab_size:
        out.append(f"DeepSpec drafters propose from the full vocabulary; this drafter has a reduced draft "
                   f"vocabulary of {cfg.draft_vocab} of {cfg.vocab_size} tokens")
    if cfg.mask_token is None and (mask_token_id is None or not 0 <= int(mask_token_id) < cfg.vocab_size):
        out.append(f"the drafter has a learned mask vector; mask_token_id: expected an unused token id in "
                   f"[0, {cfg.vocab_size}) to hold it, got {mask_token_id!r}")
    if cfg.confidence and cfg.confidence_prev and cfg.head == "none":
        out.append("a confidence head reading W1 needs a Markov head in DeepSpec (markov_rank > 0); this drafter "
                   "has none")
    return out


def save_deepspec_drafter(drafter: Drafter, folder: str | os.PathLike, *, embed: jax.Array | None = None,
                          lm_head: jax.Array | None = None, mask_token_id: int | None = None,
                          target_layer_ids: tuple[int, ...] | None = None, num_target_layers: int | None = None,
                          dtype: Any = None, attach: Sequence[str | os.PathLike] = ()) -> Path:
    """Write a drafter as a DeepSpec ``Qwen3DSparkModel`` folder (``config.json`` + ``model.safetensors``),
    atomically, where the architectures allow it (`deepspec_refusals`).

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
      attach: files copied beside the weights under their own names (``sts.json``, ``calibration.json``: the
        format has no place for them).
    Returns:
      the folder.
    Raises:
      ValueError: naming what the architectures cannot express.
    """
    cfg = drafter.cfg
    folder = Path(folder)
    taps = writable_taps(cfg, deepspec_refusals(cfg, mask_token_id=mask_token_id), target_layer_ids,
                         "save_deepspec_drafter", "DeepSpec")
    if cfg.own_embeddings:
        emb, head = drafter.embed[...], drafter.lm_head[...]
    else:  # the drafter shares the target's
        emb, head = target_embedding_and_head(cfg, embed, lm_head, "save_deepspec_drafter")
    mask = cfg.mask_token
    if mask is None:
        mask = int(mask_token_id)
        emb = emb.at[mask].set(drafter.mask_embed[...].astype(emb.dtype))
    store = jnp.dtype(dtype or drafter.ctx_proj.kernel[...].dtype)
    tensors = file_tensors(drafter, shared_tensor_map(cfg), store)
    tensors["embed_tokens.weight"] = np.asarray(emb.astype(store))
    tensors["lm_head.weight"] = np.asarray(head.T.astype(store))
    hf = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", **qwen3_config(cfg),
        "block_size": cfg.block, "mask_token_id": mask, "target_layer_ids": list(taps), "num_anchors": 512,
        "markov_rank": 0 if cfg.head == "none" else cfg.rank,
        "enable_confidence_head": cfg.confidence, "dtype": str(store), "torch_dtype": str(store),
    }
    if cfg.head != "none":
        hf["markov_head_type"] = {v: k for k, v in MARKOV_HEADS.items()}[cfg.head]
    if cfg.confidence:
        hf["confidence_head_with_markov"] = cfg.confidence_prev
    if num_target_layers is not None:
        hf["num_target_layers"] = int(num_target_layers)
    write_checkpoint(folder, tensors, hf, attach)
    return folder


def write_checkpoint(folder: Path, tensors: dict[str, np.ndarray], config: dict[str, Any],
                     attach: Sequence[str | os.PathLike] = ()) -> None:
    """Write ``model.safetensors`` and ``config.json`` (and copies of the ``attach`` files) into ``folder``,
    atomically: it is either the old folder or the complete new one."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    attach = [Path(f) for f in attach]
    for f in attach:
        if f.name in ("config.json", WEIGHTS):
            raise ValueError(f"attach: {f} would overwrite the checkpoint's own {f.name}")
    with atomic_folder(folder) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in attach:
            shutil.copyfile(f, tmp / f.name)


def qwen3_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The Qwen3 config fields of a drafter's layers, as DeepSpec's config and speculators'
    ``transformer_layer_config`` write them."""
    return {
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base, "rope_parameters": {"rope_theta": cfg.rope_base, "rope_type": "default"},
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "layer_types": ["full_attention"] * cfg.n_layers, "use_sliding_window": False, "sliding_window": None,
    }


def target_embedding_and_head(cfg: DrafterConfig, embed: jax.Array | None, lm_head: jax.Array | None, who: str
                              ) -> tuple[jax.Array, jax.Array]:
    """The target's embedding [V, D] and LM head [D, V] (``lm_head`` None: tied, ``embed.T``), checked against
    the drafter's config.

    Raises:
      ValueError: (``who``: the caller, for the message) ``embed`` not given, or either misshaped.
    """
    if embed is None:
        raise ValueError(f"{who}: the target's embedding and LM head are needed here; pass embed= (and lm_head= "
                         f"unless tied)")
    emb = jnp.asarray(embed)
    head = emb.T if lm_head is None else jnp.asarray(lm_head)
    if emb.shape != (cfg.vocab_size, cfg.dim) or head.shape != (cfg.dim, cfg.vocab_size):
        raise ValueError(f"{who}: embed {emb.shape} / lm_head {head.shape}: expected "
                         f"({cfg.vocab_size}, {cfg.dim}) / ({cfg.dim}, {cfg.vocab_size})")
    return emb, head
