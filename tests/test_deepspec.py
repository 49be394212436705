"""DeepSpec drafters (DFlash, DSpark) loaded into our drafter: parity with DeepSpec's own PyTorch modules, export
back, bad-input errors, and lossless decoding through the engine with an imported drafter.

The PyTorch reference is DeepSpec's code in ../shared/reference/deepspec (MIT), imported here only; the parity
and export tests skip where it (or torch/transformers) is absent. The engine tests read a DeepSpec folder written
by our exporter (checked against DeepSpec's loader by the export test), so they run without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import engine as eng
from dspark_jax.models import drafter as dr
from dspark_jax.models.deepspec import (
    check_drafter_fits,
    deepspec_drafter_config,
    is_deepspec_folder,
    load_deepspec_drafter,
    save_deepspec_drafter,
)
from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights

ROOT = Path(__file__).resolve().parents[1]
# DeepSpec's reference code: $DEEPSPEC_REFERENCE, else shared/ beside the checkout or inside it.
REFERENCES = [Path(p) for p in (os.environ.get("DEEPSPEC_REFERENCE"),) if p] + [
    ROOT.parent / "shared" / "reference" / "deepspec", ROOT / "shared" / "reference" / "deepspec"]

V, D, G, S_CTX = 48, 32, 4, 11  # vocabulary, width, block, context tokens of the parity case
TAPS = [0, 1]
# (markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov)
VARIANTS = {
    "dflash": (0, None, False, False),
    "dspark-vanilla": (8, "vanilla", True, True),
    "dspark-gated": (8, "gated", True, False),
    "dspark-rnn": (8, "rnn", True, True),
}


@contextlib.contextmanager
def _on_path(path: Path):
    sys.path.insert(0, str(path))
    try:
        yield
    finally:
        sys.path.remove(str(path))


@pytest.fixture(scope="module")
def deepspec():
    """DeepSpec's Qwen3DSparkModel class, or a skip."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = next((p for p in REFERENCES if (p / "deepspec").is_dir()), None)
    if root is None:
        pytest.skip("DeepSpec's reference code (../shared/reference/deepspec) is absent")
    with _on_path(root.resolve()):
        try:
            mod = importlib.import_module("deepspec.modeling.dspark.qwen3.modeling")
        except ImportError as err:  # an optional package DeepSpec imports is missing
            pytest.skip(f"DeepSpec's modules do not import here: {err}")
    torch.set_grad_enabled(False)
    return mod.Qwen3DSparkModel


def build_torch_drafter(Model, variant: str, seed: int = 0, n_layers: int = 2, vocab: int = V, mask: int | None = None):
    """A tiny random DeepSpec drafter (float32, eager attention), weights drawn large enough for clear margins."""
    import torch
    from transformers import Qwen3Config

    rank, kind, conf, conf_markov = VARIANTS[variant]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=D, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    cfg.target_layer_ids = list(TAPS)
    cfg.num_target_layers = 3
    cfg.block_size = G
    cfg.mask_token_id = vocab - 1 if mask is None else mask
    cfg.num_anchors = 8
    cfg.markov_rank = rank
    if kind is not None:
        cfg.markov_head_type = kind
    cfg.enable_confidence_head = conf
    if conf:
        cfg.confidence_head_with_markov = conf_markov
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Model(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def torch_block(model, ctx, anchor: int):
    """DeepSpec's inference path for one block: backbone over [context ; anchor, MASK...], base logits,
    greedy sequential sampling with the Markov bias, confidence logits (as its evaluator's draft_ops)."""
    import torch

    ids = torch.full((1, G), int(model.mask_token_id), dtype=torch.long)
    ids[0, 0] = anchor
    pos = torch.arange(S_CTX + G)[None]
    h = model._forward_backbone(target_hidden_states=ctx, noise_embedding=model.embed_tokens(ids), position_ids=pos,
                                attention_mask=None, is_causal=False)
    base = model.compute_logits(h)
    tokens, corrected = model.sample_draft_tokens(base, first_prev_token_ids=ids[:, 0], temperature=0.0,
                                                  hidden_states=h)
    prev = torch.cat([ids[:, :1], tokens[:, :-1]], dim=1)
    conf = model.predict_confidence_step(h, prev_token_ids=prev)
    out = dict(h=h[0], base=base[0], tokens=tokens[0], corrected=corrected[0], prev=prev[0])
    out = {k: v.numpy() for k, v in out.items()}
    out["conf"] = None if conf is None else conf[0].numpy()
    return out


def ours_block(drafter: dr.Drafter, ctx: np.ndarray, anchor: int, prev: np.ndarray):
    """Our drafter on the same context features and anchor: hidden states, base and corrected logits along
    DeepSpec's greedy tokens, and the cached inference path (`draft`) at temperature 0."""
    graph, state = nnx.split(drafter)
    out = _ours_block(graph, state, jnp.asarray(ctx.reshape(S_CTX, len(TAPS), D)), jnp.int32(anchor),
                      jnp.asarray(prev))
    return {k: np.asarray(v) for k, v in out.items()}


@functools.partial(jax.jit, static_argnums=0)
def _ours_block(graph, state, taps, anchor, prev):
    """One compiled program per drafter variant (faster than op-by-op on a 2-core CPU)."""
    drafter = nnx.merge(graph, state)
    head_w = dr.draft_head_weights(drafter, None)
    k, v = drafter.context_kv(taps[None], jnp.arange(S_CTX)[None])  # [L, 1, S, K, E]
    h = drafter.hidden(k, v, jnp.ones((1, 1, S_CTX), bool), anchor[None, None], jnp.array([[S_CTX]]), None)[0, 0]
    corrected, conf = drafter.teacher_forced(h, prev, head_w)
    cache = dr.init_drafter_cache(drafter.cfg, 2, 32)
    cache = dr.write_context(drafter, cache, taps, jnp.ones(S_CTX, jnp.int32), jnp.arange(S_CTX),
                             jnp.ones(S_CTX, bool))
    tokens, probs, conf_draft = dr.draft(drafter, cache, jnp.array([1]), jnp.array([S_CTX]), anchor[None],
                                         jax.random.split(jax.random.key(0), 1), jnp.float32(0.0), None, head_w)
    return dict(h=h, base=h @ head_w, corrected=corrected, conf=conf, tokens=tokens[0], conf_draft=conf_draft[0])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_deepspec(deepspec, variant, tmp_path):
    """Per-slot draft logits, Markov-biased logits and confidences of the loaded drafter match DeepSpec's
    PyTorch model for the same context features and anchor (float32; tolerance 2e-5 + 1e-4 relative)."""
    import torch

    model = build_torch_drafter(deepspec, variant, seed=len(variant))
    model.save_pretrained(tmp_path / "d")
    assert is_deepspec_folder(tmp_path / "d")
    drafter, meta = load_deepspec_drafter(tmp_path / "d")
    assert meta["format"] == "deepspec" and drafter.cfg.tap_layers == tuple(TAPS)
    ctx = torch.randn(1, S_CTX, len(TAPS) * D, generator=torch.Generator().manual_seed(7))
    anchor = 5
    ref = torch_block(model, ctx, anchor)
    ours = ours_block(drafter, ctx.numpy()[0], anchor, ref["prev"])
    tol = dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(ours["h"], ref["h"], **tol)
    np.testing.assert_allclose(ours["base"], ref["base"], **tol)
    np.testing.assert_allclose(ours["corrected"], ref["corrected"], **tol)
    np.testing.assert_array_equal(ours["tokens"], ref["tokens"])  # greedy drafts, slot by slot
    if variant != "dflash":  # the Markov bias matters: the corrected logits differ from the base ones
        assert np.abs(ref["corrected"] - ref["base"]).max() > 0.1
    if ref["conf"] is not None:
        np.testing.assert_allclose(ours["conf"], ref["conf"], **tol)
        np.testing.assert_allclose(ours["conf_draft"], ref["conf"], **tol)


@pytest.mark.parametrize("variant,dtype", [("dspark-rnn", "bfloat16"), ("dspark-vanilla", "float32")])
def test_rounds_over_a_growing_cache_match_deepspec_evaluator(deepspec, variant, dtype, tmp_path):
    """Decoding rounds as DeepSpec's evaluator runs them (`draft_ops`: the drafter's KV cache extended by each
    round's new context, the block's entries cropped after it) against ours (`write_context` of the same new
    context, followed by junk at the positions a rejected block would leave, then `draft`): the same greedy
    drafts and confidence logits at every round. The bfloat16 case reads a checkpoint stored in bfloat16."""
    import torch
    from transformers import DynamicCache

    root = next(p for p in REFERENCES if (p / "deepspec").is_dir())
    with _on_path(root.resolve()):
        ops = importlib.import_module("deepspec.eval.dspark.draft_ops")
    model = build_torch_drafter(deepspec, variant, seed=11)
    inv_freq = model.rotary_emb.inv_freq.clone()  # a buffer: casting the model would round it too
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "d")
    model = model.float()  # the stored (rounded) weights, computed in float32 as ours are
    model.rotary_emb.inv_freq.copy_(inv_freq)
    drafter, _ = load_deepspec_drafter(tmp_path / "d")

    class Cache(DynamicCache):  # DeepSpec crops to a length; newer transformers take the count to drop instead
        def crop(self, length):
            drop = self.get_seq_length() - length
            if drop > 0:
                super().crop(-drop)

    gen = torch.Generator().manual_seed(5)
    starts = [6, 9, 10, 16, 23]  # each round's anchor position: the context grows by 3, 1, 6, 7 tokens
    taps = torch.randn(1, starts[-1], len(TAPS) * D, generator=gen)
    tokens = torch.randint(0, V - 1, (starts[-1] + 1,), generator=gen)
    cache, dcache = Cache(), dr.init_drafter_cache(drafter.cfg, 1, 64)
    head_w = dr.draft_head_weights(drafter, None)
    rng, done = np.random.default_rng(0), 0
    for start in starts:
        ids = torch.full((1, G), int(model.mask_token_id), dtype=torch.long)
        ids[0, 0] = tokens[start]
        h = ops.forward_dspark_draft_block(model, draft_input_ids=ids, position_ids=torch.arange(64)[None],
                                           past_key_values_draft=cache, target_hidden_states=taps[:, done:start],
                                           start=start, block_size=G)
        ref = ops.build_dspark_proposal(model, draft_input_ids=ids, block_hidden=h, block_size=G, temperature=0.0,
                                        confidence_threshold=0.0)
        junk = rng.normal(size=(G, len(TAPS) * D)).astype(np.float32)  # what a rejected block leaves behind
        new = np.concatenate([taps[0, done:start].numpy(), junk]).reshape(-1, len(TAPS), D)
        n = new.shape[0]
        dcache = dr.write_context(drafter, dcache, jnp.asarray(new), jnp.zeros(n, jnp.int32),
                                  done + jnp.arange(n), jnp.ones(n, bool))
        got, _, conf = dr.draft(drafter, dcache, jnp.array([0]), jnp.array([start]), jnp.array([int(tokens[start])]),
                                jax.random.split(jax.random.key(0), 1), jnp.float32(0.0), None, head_w)
        np.testing.assert_array_equal(np.asarray(got[0]), ref.verify_input_ids[0, 1:].numpy(), err_msg=str(start))
        np.testing.assert_allclose(np.asarray(conf[0]), ref.confidence_logits[0].numpy(), rtol=1e-4, atol=2e-5)
        done = start


def test_export_round_trip(deepspec, tmp_path):
    """A loaded drafter written back is DeepSpec's model again, tensor for tensor."""
    import torch

    model = build_torch_drafter(deepspec, "dspark-gated", seed=3)
    model.save_pretrained(tmp_path / "a")
    drafter, _ = load_deepspec_drafter(tmp_path / "a")
    save_deepspec_drafter(drafter, tmp_path / "b", num_target_layers=3)
    again = deepspec.from_pretrained(tmp_path / "b", attn_implementation="eager").eval()
    want, have = model.state_dict(), again.state_dict()
    assert sorted(want) == sorted(have)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)


def test_export_refuses_what_deepspec_cannot_express():
    cfg = dr.DrafterConfig(vocab_size=V, dim=D, n_taps=2, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                           ffn_dim=16, block=G, rank=4)
    d = nnx.eval_shape(lambda: dr.Drafter(cfg, rngs=nnx.Rngs(0)))  # the refusal reads the config only
    with pytest.raises(ValueError, match="qk_norm"):
        save_deepspec_drafter(d, "/nonexistent/x")
    normed = nnx.eval_shape(lambda: dr.Drafter(dataclasses.replace(cfg, qk_norm=True, tap_norm=True),
                                               rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="tap_norm"):
        save_deepspec_drafter(normed, "/nonexistent/x")


def _hf_config(**over):
    hf = dict(architectures=["Qwen3DSparkModel"], hidden_size=D, vocab_size=V, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6,
              rope_theta=1e4, target_layer_ids=[0, 1], block_size=G, mask_token_id=V - 1, markov_rank=8,
              markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True)
    hf.update(over)
    return hf


@pytest.mark.parametrize("over, match", [
    (dict(markov_head_type="lstm"), "'markov_head_type' = 'lstm'"),
    (dict(target_layer_ids=[-1, 1]), "'target_layer_ids'.*-1"),
    (dict(mask_token_id=V), "'mask_token_id' = 48"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "'rope_parameters'.*yarn"),
    (dict(block_size="7"), "'block_size' = '7', expected int"),
    (dict(enable_confidence_head=True, confidence_head_with_markov=True, markov_rank=0), "markov_rank > 0"),
])
def test_bad_config_fields_are_named(over, match):
    with pytest.raises(ValueError, match=match) as err:
        deepspec_drafter_config(_hf_config(**over), "/x/config.json")
    assert "/x/config.json" in str(err.value)


def test_drafter_that_does_not_fit_the_target_is_refused():
    cfg = deepspec_drafter_config(_hf_config(), "/x/config.json")
    target = LlamaConfig.tiny(vocab_size=V, n_layers=3, tap_layers=(0, 1))
    check_drafter_fits(cfg, target, "/x/config.json")  # fits
    with pytest.raises(ValueError, match=r"/x/config.json: hidden_size = 32, but the target's width .* 64"):
        check_drafter_fits(cfg, LlamaConfig.tiny(vocab_size=V, dim=64, n_layers=3), "/x/config.json")
    with pytest.raises(ValueError, match=r"vocab_size = 48, but the target's vocabulary has 64"):
        check_drafter_fits(cfg, LlamaConfig.tiny(n_layers=3), "/x/config.json")
    with pytest.raises(ValueError, match=r"target_layer_ids = \[0, 1\] holds \[1\].*2 layers"):
        check_drafter_fits(cfg, LlamaConfig.tiny(vocab_size=V, tap_layers=(0,)), "/x/config.json")
    with pytest.raises(ValueError, match="num_target_layers = 36, but the target has 3 layers"):
        check_drafter_fits(cfg, target, "/x/config.json", num_target_layers=36)


def test_missing_and_misshaped_tensors_are_named(deepspec, tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_torch_drafter(deepspec, "dspark-vanilla", n_layers=1)
    model.save_pretrained(tmp_path / "d")
    weights = load_file(tmp_path / "d" / "model.safetensors")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in weights.items() if "markov_w2" not in k}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="markov_head.markov_w2.weight"):
        load_deepspec_drafter(tmp_path / "m")
    weights["fc.weight"] = weights["fc.weight"][:, :D].contiguous()
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'fc.weight' has shape \[32, 32\], "
                                         r"expected \[32, 64\]"):
        load_deepspec_drafter(tmp_path / "m")


# ------------------------------------------------------------------------------------------------------------
# Through the engine: a tiny Qwen3-style target (QK-norm, untied embeddings: what models/hf.py builds from a
# Qwen3 checkpoint) whose width, vocabulary and tapped layers fit the imported drafter.


def tiny_target(vocab=V, seed=0, scale=0.3):
    cfg = LlamaConfig.tiny(vocab_size=vocab, n_layers=3, tap_layers=tuple(TAPS), qk_norm=True,
                           tie_embeddings=False)
    return LlamaModel(cfg, init_random_weights(cfg, jax.random.key(seed), scale=scale), None)


def is_greedy_continuation(target: LlamaModel, prompt: list[int], output: list[int]) -> bool:
    """Whether ``output`` is plain greedy decoding's continuation of ``prompt``: every token is the argmax of the
    target's teacher-forced logits after the tokens before it (one scoring pass; the unique such sequence)."""
    logits = np.asarray(target.score(list(prompt) + list(output[:-1]), capacity=64))  # [P + n - 1, V]
    return np.argmax(logits[len(prompt) - 1:], axis=-1).tolist() == list(output)


def random_deepspec_folder(folder: Path, vocab: int = V, seed: int = 0) -> Path:
    """A random one-layer DSpark drafter (vanilla Markov head, confidence head on [h ; W1]) written in DeepSpec's
    format by our exporter (which test_export_round_trip checks against DeepSpec's own loader), so that the
    engine tests run without DeepSpec's code. Weights are drawn as in `build_torch_drafter`."""
    cfg = dr.DrafterConfig(vocab_size=vocab, dim=D, n_taps=len(TAPS), n_layers=1, n_heads=4, n_kv_heads=2,
                           head_dim=8, ffn_dim=64, block=G, head="markov", rank=8, confidence=True, rope_base=1e4,
                           norm_eps=1e-6, qk_norm=True, mask_token=vocab - 1, own_embeddings=True,
                           tap_layers=tuple(TAPS))
    drafter = dr.Drafter(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        shape = var.get_value().shape
        value = 1.0 + 0.1 * rng.standard_normal(shape) if path[-1] == "scale" else 0.3 * rng.standard_normal(shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return save_deepspec_drafter(drafter, folder, num_target_layers=3)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return random_deepspec_folder(tmp_path_factory.mktemp("deepspec") / "dspark", seed=4)


def test_greedy_with_an_imported_dspark_drafter_equals_plain_decoding(imported):
    target = tiny_target()
    drafter, _ = load_deepspec_drafter(imported, target.cfg)
    rng = np.random.default_rng(0)
    ps = [rng.integers(1, V - 1, size=n).tolist() for n in (3, 9)]
    sps = np.linspace(10.0, 1.0, 48).astype(np.float32)
    e = eng.Engine(target, drafter, "dspark", eng.EngineConfig(num_slots=2, capacity=32), sps=sps, stop_ids=[])
    out = e.run(ps, 10)
    assert all(len(c.output_ids) == 10 and is_greedy_continuation(target, p, c.output_ids) for p, c in zip(ps, out))
    assert e.summary()["drafts_per_request"] > 0  # drafts were verified, some rejected: a real comparison
    assert 0 < e.summary()["rejected_share"] < 1


def test_sampled_output_with_an_imported_drafter_follows_the_target(tmp_path):
    from tests.helpers import assert_follows_law
    from tests.test_engine import exact_joint

    vocab = 4
    random_deepspec_folder(tmp_path / "d", vocab=vocab, seed=5)
    target = tiny_target(vocab=vocab, seed=1, scale=0.15)
    drafter, _ = load_deepspec_drafter(tmp_path / "d", target.cfg)
    prompt, m, n_req = [1, 2, 3, 1], 3, 600
    law = exact_joint(target, prompt, m, vocab)
    e = eng.Engine(target, drafter, "dspark", eng.EngineConfig(num_slots=8, capacity=32, temperature=1.0, seed=11),
                   sps=np.linspace(10, 4, 64).astype(np.float32), stop_ids=[])
    out = e.run([prompt] * n_req, m)
    assert_follows_law([c.output_ids for c in out], law)
    assert e.summary()["drafts_per_request"] > 0


def test_draft_option_finds_a_deepspec_folder_and_the_target_taps_its_layers(imported, tmp_path):
    from dspark_jax.build import build_engine, load_drafter_for
    from dspark_jax.drafters import drafter_format, resolve_drafter

    assert drafter_format(imported) == "deepspec"
    cfg = LlamaConfig.tiny(vocab_size=V, n_layers=3)  # default taps (1, 1, 0, 0, 0): not the drafter's
    target = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0)), None)
    loaded = load_drafter_for(target, str(imported))
    assert loaded.drafter.cfg.tap_layers == tuple(TAPS) and loaded.drafter.cfg.own_embeddings
    with pytest.raises(ValueError, match=r"reads target layers \(0, 1\), but the target taps \(1, 1, 0, 0, 0\)"):
        eng.Engine(target, loaded.drafter, "fixed:2", eng.EngineConfig(num_slots=1, capacity=32))
    engine = build_engine(target, "fixed:2", draft=loaded, num_slots=1, max_prompt_tokens=8, max_new_tokens=4)
    assert engine.target.cfg.tap_layers == tuple(TAPS) and engine.target.weights is target.weights
    with pytest.raises(ValueError, match=r"hidden_size = 32, but the target's width \(hidden_size\) is 64"):
        resolve_drafter(str(imported), target_cfg=LlamaConfig.tiny(vocab_size=V, dim=64, n_layers=3))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="or a DeepSpec checkpoint folder"):
        resolve_drafter(str(tmp_path / "empty"))
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "config.json").write_text(json.dumps({"speculators_model_type": "dspark", "block_size": 8}))
    with pytest.raises(ValueError, match="'transformer_layer_config' is missing"):  # read as speculators
        resolve_drafter(str(tmp_path / "spec"))


def test_a_drafter_that_cannot_fit_fails_before_the_target_loads(imported, tmp_path, monkeypatch):
    from dspark_jax import generate

    model = tmp_path / "qwen3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 36}))
    monkeypatch.setattr(generate, "load_target", lambda *a, **k: pytest.fail("the target must not load"))
    with pytest.raises(SystemExit):
        generate.main(["--prompt", "x", "--model", str(model), "--draft", str(imported)])
    from dspark_jax.drafters import precheck_for_model

    with pytest.raises(ValueError, match=r"config.json: hidden_size = 32, but the target's width"):
        precheck_for_model(str(imported), model)
    (model / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": D, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"num_target_layers = 3, but the target has 2 layers"):
        precheck_for_model(str(imported), model)


def test_docstring_examples():
    import doctest

    from dspark_jax.models import deepspec

    result = doctest.testmod(deepspec, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
