"""Hugging Face checkpoint folders as targets: read (`load_hf_model`) and write (`save_hf`).

A folder holds ``config.json``, the weights (``model.safetensors``, or shards named by
``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json`` and usually
``generation_config.json``. Supported architectures: ``LlamaForCausalLM`` (Llama 2, 3, 3.1+ with its RoPE scaling,
SmolLM, SmolLM2), ``MistralForCausalLM`` without a sliding window, ``Qwen2ForCausalLM`` (q/k/v biases) and
``Qwen3ForCausalLM`` (RMSNorm of q and k per head).

Everything is checked before any weight is read: the architecture and config fields, and the name, shape and
dtype of every tensor (from the safetensors headers). Then the weights are read one tensor at a time, moved to
the device in their stored dtype, and cast and transposed there into that layer's array; the host never holds
more than one tensor, nor a float32 copy of a bfloat16 checkpoint.

Hugging Face stores projections as [out, in] (applied as x @ W.T); this project applies [in, out] (x @ W), so
each is transposed. Hugging Face's Q/K rows are already in the rotate-half order the model uses (llama.cpp's
GGUF files are the ones that need un-permuting, see `models.gguf`).

Axis legend: L layers, D width, F FFN width, V vocabulary, H query heads, K key/value heads, E head dimension.

Command line (convert a GGUF file into a Hugging Face folder):

    python -m dspark_jax.models.hf --from-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2-hf
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dspark_jax.io import read_json_object
from dspark_jax.models.llama import LayerWeights, LlamaConfig, LlamaModel, LlamaWeights, RopeScaling, layer_arrays

__all__ = ["HFCheckpointError", "ARCHITECTURES", "read_hf_config", "check_hf_checkpoint", "hf_config_dict",
           "load_hf_model", "save_hf", "main"]

# architecture -> (model_type, q/k norm, q/k/v bias)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", False, True),
    "Qwen3ForCausalLM": ("qwen3", True, False),
}
# LayerWeights field -> (tensor name inside model.layers.{i}., transposed from [out, in])
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
}
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


class HFCheckpointError(ValueError):
    """A Hugging Face folder this loader cannot use: the message names the file, the field and what was expected."""


# ----------------------------------------------------------------------------------------------------
# Config


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, error=HFCheckpointError)


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from transformers 5's ``rope_parameters`` or the older ``rope_theta`` and
    ``rope_scaling``."""
    # as transformers reads them: a non-empty rope_scaling wins over rope_parameters; the dict's own rope_theta
    # over the top-level one
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    scaling = raw.get(field) or None
    theta = raw.get("rope_theta", 10000.0)
    if isinstance(scaling, dict):
        theta = scaling.get("rope_theta", theta)
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise HFCheckpointError(f"{where}: field 'rope_theta' must be a positive number; got {theta!r}")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise HFCheckpointError(f"{where}: field {field!r} must be an object or null; got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    try:
        if kind == "linear":
            return float(theta), RopeScaling(kind="linear", factor=float(scaling["factor"]))
        if kind == "llama3":
            # the pretraining length: a top-level field first, then the dict's, then max_position_embeddings
            original = raw.get("original_max_position_embeddings",
                               scaling.get("original_max_position_embeddings", raw.get("max_position_embeddings")))
            if original is None:
                raise KeyError("original_max_position_embeddings")
            return float(theta), RopeScaling(
                kind="llama3", factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]), original_max_positions=int(original))
    except KeyError as e:
        raise HFCheckpointError(f"{where}: field {field!r} of rope_type {kind!r} lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise HFCheckpointError(f"{where}: field {field!r}: {e}") from None
    raise HFCheckpointError(f"{where}: field {field!r} has rope_type {kind!r}; supported: default, linear, llama3")


def read_hf_config(folder: str | Path) -> LlamaConfig:
    """The LlamaConfig of a checkpoint folder's ``config.json``.

    Args:
      folder: the checkpoint folder.
    Returns:
      the config (``qk_norm`` for Qwen3, ``attn_bias`` for Qwen2, ``rope_scaling`` from the file).
    Raises:
      HFCheckpointError: an unsupported architecture or feature (sliding window, biases a model does not have,
        an activation other than SiLU), or a missing or malformed field; the message names the file and field.
    """
    where = Path(folder) / "config.json"
    raw = _read_json(where)
    archs = raw.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not archs:  # as transformers does without the field: the model_type names the architecture
        known = [a for a, spec in ARCHITECTURES.items() if spec[0] == raw.get("model_type")]
    if not known:
        raise HFCheckpointError(f"{where}: field 'architectures' is {archs!r} (model_type {raw.get('model_type')!r}); "
                                f"supported: {', '.join(ARCHITECTURES)}")
    model_type, qk_norm, attn_bias = ARCHITECTURES[known[0]]

    def need(name: str, kind=int):
        if name not in raw or raw[name] is None:
            raise HFCheckpointError(f"{where}: field {name!r} is missing ({known[0]} needs it)")
        value = raw[name]
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise HFCheckpointError(f"{where}: field {name!r} must be a positive integer; got {value!r}")
        return value

    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise HFCheckpointError(f"{where}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name) and not (name == "attention_bias" and attn_bias):
            raise HFCheckpointError(f"{where}: field {name!r} is true; {known[0]} is supported without it")
    # transformers' MistralConfig takes a missing sliding_window as 4096
    window = raw.get("sliding_window", 4096) if model_type == "mistral" else None
    if window is not None:
        raise HFCheckpointError(f"{where}: field 'sliding_window' is {window}"
                                f"{'' if 'sliding_window' in raw else ' (missing: 4096, as transformers reads it)'}; "
                                f"sliding-window attention is not supported (expected null)")
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
        raise HFCheckpointError(f"{where}: field 'use_sliding_window'/'layer_types' asks for sliding-window "
                                f"attention, which is not supported (expected full attention in every layer)")
    dim, n_heads = need("hidden_size"), need("num_attention_heads")
    n_kv = raw.get("num_key_value_heads") or n_heads
    # Qwen3Config's head_dim defaults to 128 (not hidden_size / heads); the others derive it
    head_dim = raw.get("head_dim", 128 if model_type == "qwen3" else None) or dim // n_heads
    theta, scaling = _rope(raw, str(where))
    eps = raw.get("rms_norm_eps", 1e-6)
    try:
        return LlamaConfig(vocab_size=need("vocab_size"), dim=dim, n_layers=need("num_hidden_layers"),
                           n_heads=n_heads, n_kv_heads=int(n_kv), head_dim=int(head_dim),
                           ffn_dim=need("intermediate_size"), rope_base=theta, norm_eps=float(eps),
                           tie_embeddings=bool(raw.get("tie_word_embeddings", False)), rope_scaling=scaling,
                           qk_norm=qk_norm, attn_bias=attn_bias)
    except ValueError as e:
        raise HFCheckpointError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------------------------
# Tensors


def _expected_tensors(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by Hugging Face name, with its stored shape ([out, in] for projections)."""
    D, F, V, E = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.head_dim
    HE, KE = cfg.n_heads * E, cfg.n_kv_heads * E
    per_layer = {"attn_norm": (D,), "wq": (HE, D), "wk": (KE, D), "wv": (KE, D), "wo": (D, HE), "mlp_norm": (D,),
                 "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}
    if cfg.qk_norm:
        per_layer.update(q_norm=(E,), k_norm=(E,))
    if cfg.attn_bias:
        per_layer.update(bq=(HE,), bk=(KE,), bv=(KE,))
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        for field, shape in per_layer.items():
            out[f"model.layers.{i}.{_LAYER_TENSORS[field][0]}"] = shape
    return out


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (from the index, or the headers of every file)."""
    from safetensors import safe_open  # noqa: PLC0415

    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFCheckpointError(f"{index}: field 'weight_map' is missing or not an object")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise HFCheckpointError(f"{index}: names shard(s) {missing} that are not in {folder}")
        return {name: folder / f for name, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{folder}: no {WEIGHTS_FILE}, {INDEX_FILE} or other *.safetensors file")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                out.update({name: f for name in st.keys()})
        except Exception as e:  # safetensors raises its own error type for a bad header
            raise HFCheckpointError(f"{f}: not a readable safetensors file: {e}") from e
    return out


def check_hf_checkpoint(folder: str | Path, cfg: LlamaConfig | None = None) -> dict[str, Path]:
    """Check, from the headers only, that every tensor `cfg` needs is there with its shape and a float dtype.

    Args:
      folder: the checkpoint folder.
      cfg: its config (default: `read_hf_config`).
    Returns:
      tensor name -> the file holding it.
    Raises:
      HFCheckpointError: naming the tensor, the file, and the expected and found shape or dtype.
    """
    from safetensors import safe_open  # noqa: PLC0415

    folder = Path(folder)
    cfg = read_hf_config(folder) if cfg is None else cfg
    files = _tensor_files(folder)
    expected = _expected_tensors(cfg)
    absent = [name for name in expected if name not in files]
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise HFCheckpointError(f"{folder}: tensor {absent[0]!r}{more} is missing from the safetensors files "
                                f"(config.json asks for {len(expected)} tensors)")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="numpy") as st:
            for name in names:
                if name not in st.keys():
                    raise HFCheckpointError(f"{path}: tensor {name!r} is missing (the index names this file)")
                sl = st.get_slice(name)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if shape != expected[name]:
                    raise HFCheckpointError(f"{path}: tensor {name!r} has shape {list(shape)}, expected "
                                            f"{list(expected[name])} from config.json")
                if dtype not in _FLOAT_DTYPES:
                    raise HFCheckpointError(f"{path}: tensor {name!r} has dtype {dtype}; expected one of "
                                            f"{', '.join(_FLOAT_DTYPES)} (quantized checkpoints are not supported)")
    return {name: files[name] for name in expected}


def load_hf_model(folder: str | Path, dtype: Any = jnp.float32) -> LlamaModel:
    """Load a Hugging Face checkpoint folder as a target: config, weights in `dtype` on the device, tokenizer.

    Args:
      folder: holds config.json, *.safetensors (with model.safetensors.index.json when sharded),
        tokenizer.json, tokenizer_config.json and optionally generation_config.json.
      dtype: the weights' dtype on the device.
    Returns:
      the `LlamaModel` (its tokenizer an `HFTokenizer`).
    Raises:
      HFCheckpointError (a ValueError): a bad config, tensor or tokenizer, found before any weight is read.
    """
    from safetensors import safe_open  # noqa: PLC0415

    from dspark_jax.tokenizer import HFTokenizer  # noqa: PLC0415

    folder = Path(folder)
    if not folder.is_dir():
        raise HFCheckpointError(f"{folder}: not a folder (expected a Hugging Face checkpoint folder)")
    cfg = read_hf_config(folder)
    files = check_hf_checkpoint(folder, cfg)
    tokenizer = HFTokenizer.from_folder(folder)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise HFCheckpointError(f"{folder / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than config.json's "
                                f"vocab_size {cfg.vocab_size} (the embedding would be indexed out of range)")
    dtype = jnp.dtype(dtype)
    handles: dict[Path, Any] = {}

    def read(name: str) -> jax.Array:  # one tensor, on the device in its stored dtype
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="flax")
        return handles[path].get_tensor(name)

    try:
        fields = [f for f in _LAYER_TENSORS if cfg.qk_norm or f not in ("q_norm", "k_norm")]
        fields = [f for f in fields if cfg.attn_bias or f not in ("bq", "bk", "bv")]
        layers = {}
        for field in fields:
            suffix, transpose = _LAYER_TENSORS[field]
            layers[field] = layer_arrays(lambda i: read(f"model.layers.{i}.{suffix}"), cfg.n_layers, dtype,
                                         transpose=transpose)  # L arrays
        embed = read("model.embed_tokens.weight").astype(dtype)  # [V, D]
        final_norm = read("model.norm.weight").astype(dtype)  # [D]
        lm_head = None if cfg.tie_embeddings else read("lm_head.weight").T.astype(dtype)  # [D, V]
    finally:
        handles.clear()
    per_layer = tuple(LayerWeights(**{f: a[i] for f, a in layers.items()}) for i in range(cfg.n_layers))
    weights = LlamaWeights(embed=embed, layers=per_layer, final_norm=final_norm, lm_head=lm_head)
    return LlamaModel(cfg, weights, tokenizer)


# ----------------------------------------------------------------------------------------------------
# Export


def _atomic_write(path: Path, write) -> None:
    """Call write(tmp_path) for a temporary file beside `path`, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8"))


def hf_config_dict(cfg: LlamaConfig, *, bos_id: int | None = None, eos_id: int | None = None,
                   max_positions: int = 8192, dtype: Any = jnp.float32) -> dict[str, Any]:
    """A ``config.json`` for `cfg` (Llama, or Qwen3 with qk_norm, or Qwen2 with attn_bias), in the
    ``rope_theta`` + ``rope_scaling`` form that transformers 4 and 5 both read."""
    arch = "Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.attn_bias else "LlamaForCausalLM"
    if cfg.qk_norm and cfg.attn_bias:
        raise ValueError("no supported architecture has both qk_norm and attn_bias")
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                           original_max_position_embeddings=s.original_max_positions)
    return {
        "architectures": [arch], "model_type": ARCHITECTURES[arch][0], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base, "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attn_bias, "mlp_bias": False,
        "max_position_embeddings": int(max_positions), "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": jnp.dtype(dtype).name, "use_cache": True,
    }


def save_hf(model: LlamaModel, folder: str | Path, *, max_positions: int = 8192) -> Path:
    """Write a target as a Hugging Face checkpoint folder that `load_hf_model` (and transformers) can read.

    Writes config.json, model.safetensors (in the weights' dtype), and, when the model has a tokenizer,
    tokenizer.json, tokenizer_config.json (special tokens, chat template) and generation_config.json (stop ids).
    Each file is written under a temporary name and renamed into place.

    Args:
      model: the target (from a GGUF file, a folder, or random weights).
      folder: the output folder (created; files of the same names are replaced).
      max_positions: the context length config.json states.
    Returns:
      the folder.
    """
    from safetensors.flax import save_file  # noqa: PLC0415

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg, w, tok = model.cfg, model.weights, model.tokenizer
    tensors = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if w.lm_head is not None:
        tensors["lm_head.weight"] = w.lm_head.T
    for field, (suffix, transpose) in _LAYER_TENSORS.items():
        for i, lw in enumerate(w.layers):
            a = getattr(lw, field)
            if a is not None:
                tensors[f"model.layers.{i}.{suffix}"] = a.T if transpose else a
    tensors = {k: jnp.asarray(v) for k, v in tensors.items()}
    _atomic_write(folder / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    bos = getattr(tok, "bos_id", None)
    eos = getattr(tok, "eos_id", None)
    _write_json(folder / "config.json", hf_config_dict(cfg, bos_id=bos, eos_id=eos, max_positions=max_positions,
                                                       dtype=model.dtype))
    if tok is None:
        return folder
    _atomic_write(folder / "tokenizer.json", lambda tmp: tmp.write_text(tok.backend.to_str(), encoding="utf-8"))
    tok_cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_positions),
                               "add_bos_token": bool(getattr(tok, "add_bos", False)),
                               "add_eos_token": bool(getattr(tok, "add_eos", False)),
                               "clean_up_tokenization_spaces": False, **tok.special_tokens}
    if tok.chat_template is not None:
        tok_cfg["chat_template"] = tok.chat_template
    _write_json(folder / "tokenizer_config.json", tok_cfg)
    gen = {"eos_token_id": list(tok.stop_ids) if len(tok.stop_ids) > 1 else tok.stop_ids[0]}
    if bos is not None:
        gen["bos_token_id"] = bos
    _write_json(folder / "generation_config.json", gen)
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m dspark_jax.models.hf --from-gguf FILE --out DIR``: convert a GGUF target to a Hugging Face folder."""
    p = argparse.ArgumentParser(prog="python -m dspark_jax.models.hf", description=main.__doc__)
    p.add_argument("--from-gguf", required=True, help="a Llama-family GGUF file ('default': the embedded SmolLM2)")
    p.add_argument("--out", required=True, type=Path, help="the output folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the written weights")
    args = p.parse_args(argv)
    model = LlamaModel.from_gguf(None if args.from_gguf == "default" else args.from_gguf, dtype=jnp.dtype(args.dtype))
    print(save_hf(model, args.out))


if __name__ == "__main__":
    main()
