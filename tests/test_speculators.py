"""vLLM speculators DSpark and DFlash checkpoints: parity with the `speculators` package's own classes (0.9.0, the
``reference`` extra, imported here only), its DFlash converter, export in both formats, bad folders, and lossless
decoding through the engine and `generate` with a speculators drafter.

The reference drafters are built by speculators' classes around a tiny random Qwen3 checkpoint folder (the verifier,
whose embedding and LM head the format does not store). The parity tests skip where speculators is absent; the
engine, CLI and refusal tests write their folders with our exporter (checked against the reference classes by the
parity tests), so they run without it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import engine as eng
from dspark_jax.drafters import drafter_format, precheck_for_model, resolve_drafter
from dspark_jax.models import drafter as dr
from dspark_jax.models.deepspec import load_deepspec_drafter, save_deepspec_drafter
from dspark_jax.models.drafter_files import flat_state, save_drafter
from dspark_jax.models.speculators import (load_speculators_drafter, save_speculators_drafter,
                                           speculators_drafter_config)

V, D, LAYERS, G, S_CTX = 320, 64, 3, 4, 9  # target vocabulary, width, layers; block; context tokens
AUX = [1, 2]  # speculators' ids of the tapped layers: ours (0, 1)
MASK = V - 1
DRAFT_IDS = np.sort(np.random.default_rng(0).choice(V, 96, replace=False))  # a reduced draft vocabulary
# (speculators_model_type, markov_rank, markov_head_type, confidence head, confidence on W1, reduced vocabulary)
VARIANTS = {
    "dflash": ("dflash", 0, None, False, False, False),
    "dflash-reduced": ("dflash", 0, None, False, False, True),
    "dspark-vanilla-reduced": ("dspark", 8, "vanilla", True, True, True),
    "dspark-gated": ("dspark", 8, "gated", True, False, False),
    "dspark-rnn-reduced": ("dspark", 8, "rnn", True, True, True),
}


# ------------------------------------------------------------------------------------------------------------
# The verifier: a tiny random Qwen3 checkpoint folder (with a tokenizer, so that `generate --model` reads it too)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """(folder, our target loaded from it): 3 layers, untied LM head."""
    from tests.test_hf import COMMON, QWEN3_TEMPLATE, _random_init, _save_folder, transformers

    from dspark_jax.build import load_target

    model = _random_init(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{**COMMON, "num_hidden_layers": LAYERS}, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)))
    path = tmp_path_factory.mktemp("qwen3")
    tk = _save_folder(path, model, QWEN3_TEMPLATE, eos="<|im_end|>", bos=None,
                      stops=[0])  # a stop id the random target hardly emits: answers run their full length
    assert tk.get_vocab_size() <= V and COMMON["vocab_size"] == V and COMMON["hidden_size"] == D
    return path, load_target(path, dtype=jnp.float32)


@pytest.fixture(scope="module")
def spec():
    """The speculators package (the ``reference`` extra), or a skip."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators")
    torch.set_grad_enabled(False)
    import speculators.convert.dflash as convert
    import speculators.models.dflash as dflash
    import speculators.models.dspark as dspark
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return dict(dspark=(dspark.DSparkDraftModel, dspark.DSparkSpeculatorConfig),
                dflash=(dflash.DFlashDraftModel, dflash.DFlashSpeculatorConfig), convert=convert,
                SpeculatorsConfig=SpeculatorsConfig, VerifierConfig=VerifierConfig,
                Greedy=GreedyTokenProposalConfig)


def reference_config(spec, variant: str, verifier_path: Path):
    """A speculators config of ``variant`` for the tiny verifier (eager attention: float masks, runs on CPU)."""
    from transformers import Qwen3Config

    kind, rank, head, conf, conf_markov, reduced = VARIANTS[variant]
    layers = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    layers._attn_implementation = "eager"
    common = dict(
        transformer_layer_config=layers, draft_vocab_size=len(DRAFT_IDS) if reduced else V, block_size=G,
        aux_hidden_state_layer_ids=list(AUX), mask_token_id=MASK, sample_from_anchor=True,
        speculators_config=spec["SpeculatorsConfig"](
            algorithm=kind, proposal_methods=[spec["Greedy"](speculative_tokens=G)], default_proposal_method="greedy",
            verifier=spec["VerifierConfig"](name_or_path=str(verifier_path), architectures=["Qwen3ForCausalLM"])))
    if kind == "dspark":
        common.update(markov_rank=rank, markov_head_type=head or "vanilla", enable_confidence_head=conf,
                      confidence_head_with_markov=conf_markov)
    return spec[kind][1](**common)


def build_reference(spec, variant: str, verifier_path: Path, seed: int = 0):
    """A tiny random speculators drafter of ``variant``, built by the package's classes: weights drawn large enough
    for clear margins; a reduced vocabulary's W1 rows outside it made equal (what our table can hold)."""
    import torch

    kind, *_, reduced = VARIANTS[variant]
    model = spec[kind][0](reference_config(spec, variant, verifier_path))
    if reduced:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.as_tensor(DRAFT_IDS)] = True
        model.load_vocab_mappings(t2d, torch.as_tensor(DRAFT_IDS) - torch.arange(len(DRAFT_IDS)))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens", "lm_head", "verifier_")):
            continue  # the verifier's, loaded below
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                else 0.3 * torch.randn(p.shape, generator=g))
    if reduced and getattr(model, "markov_head", None) is not None:
        w1 = model.markov_head.markov_w1.weight
        w1[~model.t2d] = w1[~model.t2d][0]
    model.load_verifier_weights()
    return model.eval()


def reference_block(model, ctx, anchor: int):
    """The reference's forward for one block: `_backbone_forward` (its masks, mask-token embedding and positions)
    with a single anchor after ``ctx`` ([1, S, M * D] target hidden states), then the greedy left-to-right chain
    through its Markov head (slot k conditioned on the token before it, the anchor for slot 0, as its training
    forward does with ``sample_from_anchor``) and its confidence head. Draft indices map to tokens by ``d2t``."""
    import torch

    S, G = ctx.shape[1], model.config.block_size
    D = model.config.transformer_layer_config.hidden_size
    T = S + G + 1
    junk = 5.0 * torch.randn(1, T - S, ctx.shape[2], generator=torch.Generator().manual_seed(S))
    hidden_states = torch.cat([ctx, junk], 1)  # the anchor's and later positions: never seen by the block
    ids = torch.zeros(1, T, dtype=torch.long)
    ids[0, S] = anchor
    loss_mask = torch.zeros(1, T)
    loss_mask[0, S] = 1  # the only anchor
    h, base, *_ = model._backbone_forward(hidden_states, ids, loss_mask, torch.zeros(1, T, D),
                                          torch.zeros(1, T, dtype=torch.long), max_anchors=1)
    h, base = h[0], base[0]  # [G, D], [G, W]
    to_token = (lambda i: i + int(model.d2t[i])) if model.d2t is not None else (lambda i: i)
    markov = getattr(model, "markov_head", None)
    prev = [anchor]
    for k in range(G):
        logits = base[k]
        if markov is not None:
            chain = torch.tensor([prev + [anchor] * (G - len(prev))])
            logits = logits + markov.block_bias(prev_token_ids=chain, hidden_states=h[None])[0, k]
        prev.append(to_token(int(torch.argmax(logits))))
    chain = torch.tensor([prev[:G]])
    corrected = base if markov is None else base + markov.block_bias(prev_token_ids=chain, hidden_states=h[None])[0]
    conf = None
    if getattr(model, "confidence_head", None) is not None:
        feats = h[None]
        if model.config.confidence_head_with_markov:
            feats = torch.cat([feats, markov.prev_embeddings(chain)], -1)
        conf = model.confidence_head(feats)[0].numpy()
    return dict(h=h.numpy(), base=base.numpy(), corrected=corrected.numpy(), tokens=np.array(prev[1:]),
                prev=np.array(prev[:G]), conf=conf)


@functools.partial(jax.jit, static_argnums=0)
def _drafter_block(graph, state, taps, anchor, prev, embed, lm_head):
    """Ours on the same features: teacher-forced along the reference's chain, and the cached greedy `draft`."""
    drafter = nnx.merge(graph, state)
    head_w = dr.draft_head_weights(drafter, embed, lm_head)  # [D, W]
    S = taps.shape[0]
    positions = jnp.arange(S)
    k, v = drafter.context_kv(taps[None], positions[None])
    h = drafter.hidden(k, v, jnp.ones((1, 1, S), bool), anchor[None, None], jnp.full((1, 1), S), embed)
    corrected, conf = drafter.teacher_forced(h[0, 0], prev, head_w)
    cache = dr.write_context(drafter, dr.init_drafter_cache(drafter.cfg, 1, 16 * (S // 16 + 1)), taps,
                             jnp.zeros(S, jnp.int32), positions, jnp.ones(S, bool))
    tokens, _, conf_draft = dr.draft(drafter, cache, jnp.zeros(1, jnp.int32), jnp.full(1, S), anchor[None],
                                     jax.random.split(jax.random.key(0), 1), jnp.float32(0.0), embed, head_w)
    return dict(h=h[0, 0], base=h[0, 0] @ head_w, corrected=corrected, conf=conf, tokens=tokens[0],
                conf_draft=conf_draft[0])


def ours_block(drafter, target, ctx: np.ndarray, anchor: int, prev: np.ndarray):
    graph, state = nnx.split(drafter)
    w = target.weights
    taps = jnp.asarray(ctx.reshape(ctx.shape[0], drafter.cfg.n_taps, -1))  # [S, M, D]
    out = _drafter_block(graph, state, taps, jnp.int32(anchor), jnp.asarray(prev), w.embed, w.lm_head)
    return {k: np.asarray(v) for k, v in out.items()}


def assert_same_block(ours, ref, variant):
    tol = dict(rtol=1e-4, atol=2e-5)
    for name in ("h", "base", "corrected"):
        np.testing.assert_allclose(ours[name], ref[name], err_msg=f"{variant}: {name}", **tol)
    np.testing.assert_array_equal(ours["tokens"], ref["tokens"], err_msg=f"{variant}: greedy drafts")
    if ref["conf"] is not None:
        np.testing.assert_allclose(ours["conf"], ref["conf"], err_msg=f"{variant}: confidences", **tol)
        np.testing.assert_allclose(ours["conf_draft"], ref["conf"], err_msg=f"{variant}: confidences", **tol)


def load_in_reference(spec, variant: str, folder: Path):
    """A folder loaded by the reference class, with eager attention (its default, flex attention, needs a GPU)."""
    kind = VARIANTS[variant][0]
    model_cls, config_cls = spec[kind]
    cfg = config_cls.from_pretrained(folder)
    cfg.transformer_layer_config._attn_implementation = "eager"
    return model_cls.from_pretrained(folder, config=cfg).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_the_reference_and_export_back(spec, verifier, variant, tmp_path):
    """A speculators drafter built by the package's classes, saved by them and loaded here, gives the same hidden
    states, base logits, Markov-biased logits, greedy drafts and confidences on the same target hidden states
    (float32; 1e-4 relative); written back by our exporter it loads in the reference class tensor for tensor
    and gives the same outputs there."""
    import torch

    path, target = verifier
    model = build_reference(spec, variant, path, seed=len(variant))
    model.save_pretrained(tmp_path / "ref")
    assert drafter_format(tmp_path / "ref") == "speculators"
    drafter, meta, _, _ = resolve_drafter(str(tmp_path / "ref"), target_cfg=target.cfg)
    assert meta["format"] == "speculators" and meta["verifier"] == str(path)
    assert drafter.cfg.tap_layers == (0, 1) and not drafter.cfg.own_embeddings
    assert drafter.cfg.draft_vocab == (len(DRAFT_IDS) if VARIANTS[variant][-1] else V)
    ctx = torch.randn(1, S_CTX, len(AUX) * D, generator=torch.Generator().manual_seed(7))
    anchor = int(DRAFT_IDS[0]) + 1  # outside the reduced vocabulary: slot 0's Markov row is the shared one
    ref = reference_block(model, ctx, anchor)
    assert_same_block(ours_block(drafter, target, ctx.numpy()[0], anchor, ref["prev"]), ref, variant)
    if VARIANTS[variant][1]:  # the Markov bias matters: corrected logits differ from the base ones
        assert np.abs(ref["corrected"] - ref["base"]).max() > 0.1

    save_speculators_drafter(drafter, tmp_path / "ours", embed=target.weights.embed, lm_head=target.weights.lm_head,
                             verifier=str(path), verifier_architectures=["Qwen3ForCausalLM"])
    again = load_in_reference(spec, variant, tmp_path / "ours")
    want, have = model.state_dict(), again.state_dict()
    assert sorted(want) == sorted(have)
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)
    ref_again = reference_block(again, ctx, anchor)
    for name in ("base", "corrected", "tokens"):
        np.testing.assert_allclose(ref_again[name], ref[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_deepspec_folder_converted_by_the_reference_equals_it_loaded_directly(spec, verifier, tmp_path):
    """The layer-id convention, from the reference's own converter: a DeepSpec DFlash folder (target_layer_ids
    0, 1, read as hidden_states[i + 1]) given z-lab's ``dflash_config`` comes out of speculators' DFlashConverter
    with aux_hidden_state_layer_ids [1, 2], which this loader maps back to tap_layers (0, 1). The converter leaves
    sample_from_anchor false, z-lab's convention, which DeepSpec's DFlash does not follow: refused by name until
    set; then the converted folder loads here as the same drafter as the DeepSpec folder."""
    path, target = verifier
    w = target.weights
    cfg = dr.DrafterConfig(vocab_size=V, dim=D, n_taps=2, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           ffn_dim=96, block=G, head="none", confidence=False, rope_base=1e4, norm_eps=1e-6,
                           qk_norm=True, mask_token=MASK, tap_layers=(0, 1))
    drafter = randomized(dr.Drafter(cfg, rngs=nnx.Rngs(0)), seed=3)
    save_deepspec_drafter(drafter, tmp_path / "deepspec", embed=w.embed, lm_head=w.lm_head, num_target_layers=LAYERS)
    hf = json.loads((tmp_path / "deepspec" / "config.json").read_text())
    hf["dflash_config"] = {"target_layer_ids": hf["target_layer_ids"], "mask_token_id": hf["mask_token_id"]}
    (tmp_path / "deepspec" / "config.json").write_text(json.dumps(hf))
    spec["convert"].DFlashConverter().convert(tmp_path / "deepspec", tmp_path / "converted", str(path))
    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert converted["aux_hidden_state_layer_ids"] == [1, 2] and converted["sample_from_anchor"] is False
    with pytest.raises(ValueError, match=r"converted/config.json: field 'sample_from_anchor' = false"):
        load_speculators_drafter(tmp_path / "converted", target.cfg)
    converted["sample_from_anchor"] = True
    (tmp_path / "converted" / "config.json").write_text(json.dumps(converted))
    via, _ = load_speculators_drafter(tmp_path / "converted", target.cfg)
    direct, _ = load_deepspec_drafter(tmp_path / "deepspec", target.cfg)
    assert via.cfg.tap_layers == direct.cfg.tap_layers == (0, 1) and via.cfg.mask_token == direct.cfg.mask_token
    ctx = np.random.default_rng(1).normal(size=(S_CTX, len(AUX) * D)).astype(np.float32)
    prev = np.full(G, 7, np.int32)
    a, b = ours_block(via, target, ctx, 7, prev), ours_block(direct, target, ctx, 7, prev)
    for name in ("h", "base", "tokens"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-6, err_msg=name)


# ------------------------------------------------------------------------------------------------------------
# Export (both formats), refusals, bad folders: no reference needed


def randomized(drafter: dr.Drafter, seed: int) -> dr.Drafter:
    """Every parameter drawn as the reference builder draws them (norm scales near 1, the rest 0.3 N(0, 1))."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        shape = var.get_value().shape
        value = 1.0 + 0.1 * rng.standard_normal(shape) if path[-1] == "scale" else 0.3 * rng.standard_normal(shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return drafter


def exportable(vocab: int = V, draft_ids=None, seed: int = 0, **over) -> dr.Drafter:
    """A random one-layer DSpark drafter the speculators format holds: Qwen3 layers, the target's embedding with
    the mask token's row, a reduced draft vocabulary (``draft_ids``), tapping target layers 0 and 1."""
    cfg = dr.DrafterConfig(vocab_size=vocab, dim=D, n_taps=2, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                           ffn_dim=64, block=G, head="markov", rank=8, confidence=True, rope_base=1e4, norm_eps=1e-6,
                           qk_norm=True, mask_token=vocab - 1, tap_layers=(0, 1),
                           draft_vocab_size=0 if draft_ids is None else len(draft_ids))
    cfg = dataclasses.replace(cfg, **over)
    return randomized(dr.Drafter(cfg, rngs=nnx.Rngs(seed), vocab_ids=draft_ids), seed)


def test_check_export_decodes_the_same_with_the_read_back_drafter(verifier, tmp_path, monkeypatch, capsys):
    """`python -m train.check_export`: the export of one of our drafters, read back, decodes the same prompts with
    the same rounds, accepted drafts and tokens at T = 1 (same draws); a read-back drafter that differs (one weight
    moved) is caught: exit status 1, naming the requests."""
    from train import check_export, evaluate

    path, _ = verifier
    save_drafter(exportable(draft_ids=DRAFT_IDS, seed=2), tmp_path / "ours", dtype=np.float32)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("hi there", "a b c", "once", "why")))
    argv = ["--draft", str(tmp_path / "ours"), "--format", "speculators", "--model", str(path), "--prompts",
            str(prompts), "--half", "all", "--max-new-tokens", "12", "--temperature", "1", "--concurrency", "2"]
    result = check_export.main(argv + ["--out", str(tmp_path / "check")])
    assert result["requests_that_differ"] == [] and result["prompts"] == 4 and result["rounds"] > 4
    assert result["accept_len"] == result["accept_len_export"]
    assert json.loads((tmp_path / "check" / "check.json").read_text())["tokens"] == result["tokens"] > 0

    def moved(source, **kw):  # the export as read back, one matrix off
        drafter, meta, temps, folder = resolve_drafter(source, **kw)
        if "spec" in str(source):
            k = drafter.ctx_proj.kernel.value
            drafter.ctx_proj.kernel.value = k + jax.random.normal(jax.random.key(0), k.shape, k.dtype)
        return drafter, meta, temps, folder

    monkeypatch.setattr(evaluate, "resolve_drafter", moved)
    with pytest.raises(SystemExit) as e:
        check_export.main(argv + ["--out", str(tmp_path / "spec-check")])
    assert e.value.code == 1 and "requests that differ" in capsys.readouterr().err


def test_widen_vocab_writes_a_reduced_vocabulary_drafter_for_deepspec(verifier, tmp_path, capsys):
    """DeepSpec proposes from the full vocabulary only: a reduced-vocabulary drafter is refused with the way out
    named, and ``--widen-vocab`` writes it over every token. On its old vocabulary the widened drafter computes
    what the original does (same logits for those tokens along the same chain, same confidences); the new tokens
    take the target's LM head rows and the Markov head's out-of-vocabulary row, and the command says the drafter
    changed."""
    from dspark_jax import export

    path, target = verifier
    drafter = exportable(draft_ids=DRAFT_IDS, seed=6)
    save_drafter(drafter, tmp_path / "ours", dtype=np.float32)
    with pytest.raises(SystemExit):
        export.main(["--format", "deepspec", str(tmp_path / "ours"), str(tmp_path / "ds"), "--model", str(path)])
    assert "reduced draft vocabulary of 96 of 320 tokens (--widen-vocab" in capsys.readouterr().err
    export.main(["--format", "deepspec", str(tmp_path / "ours"), str(tmp_path / "ds"), "--model", str(path),
                 "--widen-vocab"])
    assert "widened from 96 to all 320 tokens; this is a different drafter" in capsys.readouterr().err
    wide, meta = load_deepspec_drafter(tmp_path / "ds", target.cfg)
    assert wide.cfg.draft_vocab == V
    ctx = np.random.default_rng(3).normal(size=(S_CTX, len(AUX) * D)).astype(np.float32)
    prev = np.array([5, int(DRAFT_IDS[3]), 7, int(DRAFT_IDS[9])], np.int32)  # in and out of the old vocabulary
    a, b = ours_block(drafter, target, ctx, 5, prev), ours_block(wide, target, ctx, 5, prev)
    np.testing.assert_allclose(b["corrected"][:, DRAFT_IDS], a["corrected"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b["conf"], a["conf"], rtol=1e-5, atol=1e-5)


def test_export_cli_writes_both_formats_with_their_calibration(verifier, tmp_path):
    """`python -m dspark_jax.export`: one of our drafter folders (reduced vocabulary, STS temperatures beside it)
    to speculators and back, parameter for parameter, with sts.json carried beside the weights; a full-vocabulary
    speculators drafter to DeepSpec and back, the same drafter."""
    from dspark_jax import export
    from dspark_jax.calibration import STSSets

    path, target = verifier
    w = target.weights
    drafter = exportable(draft_ids=DRAFT_IDS)
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [1.0, 1.5, 0.8, 2.0], "temperature": 1.0}))
    save_drafter(drafter, tmp_path / "ours", dtype=np.float32, attach=[sts])
    export.main(["--format", "speculators", str(tmp_path / "ours"), str(tmp_path / "spec"), "--model", str(path),
                 "--verifier", "tiny/qwen3"])
    hf = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert hf["speculators_config"]["verifier"] == {"name_or_path": "tiny/qwen3", "architectures": ["Qwen3ForCausalLM"]}
    assert hf["aux_hidden_state_layer_ids"] == [1, 2] and hf["draft_vocab_size"] == len(DRAFT_IDS)
    back, meta, temps, _ = resolve_drafter(str(tmp_path / "spec"), target_cfg=target.cfg)
    assert isinstance(temps, STSSets) and meta["format"] == "speculators"
    want, have = flat_state(drafter), flat_state(back)
    assert sorted(want) == sorted(have)
    for name in want:
        np.testing.assert_array_equal(have[name], want[name], err_msg=name)

    full = exportable(seed=1)
    save_speculators_drafter(full, tmp_path / "spec-full")
    export.main(["--format", "deepspec", str(tmp_path / "spec-full"), str(tmp_path / "deepspec"), "--model", str(path)])
    direct, _ = load_deepspec_drafter(tmp_path / "deepspec", target.cfg)
    assert direct.cfg.own_embeddings and json.loads((tmp_path / "deepspec" / "config.json").read_text())[
        "num_target_layers"] == LAYERS
    ctx = np.random.default_rng(2).normal(size=(S_CTX, len(AUX) * D)).astype(np.float32)
    prev = np.full(G, 5, np.int32)
    a, b = ours_block(full, target, ctx, 5, prev), ours_block(direct, target, ctx, 5, prev)
    for name in ("h", "corrected", "conf", "tokens"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-6, err_msg=name)
    # back to speculators: the DeepSpec drafter's own embedding and LM head are checked to be the target's
    export.main(["--format", "speculators", str(tmp_path / "deepspec"), str(tmp_path / "again"), "--model", str(path)])
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tmp_path / "spec-full" /
                                                                       "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"own embed_tokens.weight differs from the target's \(by up to 1\)"):
        save_speculators_drafter(direct, tmp_path / "x", embed=w.embed + 1.0, lm_head=w.lm_head)


@pytest.fixture(scope="module")
def smollm2_folder(target, tmp_path_factory):
    """The real target as a Hugging Face folder: the verifier whose embedding speculators' classes read."""
    from dspark_jax.models.hf import save_hf

    return save_hf(target, tmp_path_factory.mktemp("smollm2-hf"))


def check_shipped_round_trip(spec, target, verifier: Path, source: str, tmp_path: Path) -> None:
    """``python -m dspark_jax.export --format speculators SOURCE``: read back here parameter for parameter (the int8
    matrices written as the float32 they stand for), loaded by the reference class with SmolLM2 as its verifier,
    and drafting there what it drafts here on the same target hidden states."""
    import torch

    from dspark_jax import export

    export.main(["--format", "speculators", source, str(tmp_path / "spec"), "--verifier", str(verifier)])
    original, _, sts, _ = resolve_drafter(source, target_cfg=target.cfg)
    again, meta, sts_again, _ = resolve_drafter(str(tmp_path / "spec"), target_cfg=target.cfg)
    assert meta["format"] == "speculators" and (sts is None) == (sts_again is None)
    want, have = flat_state(original), flat_state(again)
    assert sorted(want) == sorted(have)
    for name in want:
        np.testing.assert_array_equal(np.asarray(have[name], np.float32), np.asarray(want[name], np.float32), name)
    kind = "dspark" if original.cfg.confidence else "dflash"
    model_cls, config_cls = spec[kind]
    cfg = config_cls.from_pretrained(tmp_path / "spec")
    cfg.transformer_layer_config._attn_implementation = "eager"
    ref_model = model_cls.from_pretrained(tmp_path / "spec", config=cfg).eval()
    ref_model.load_verifier_weights()
    n_taps, width = original.cfg.n_taps, target.cfg.dim
    ctx = torch.randn(1, 12, n_taps * width, generator=torch.Generator().manual_seed(3))
    for anchor in (28, 504):  # two anchors, two blocks
        ref = reference_block(ref_model, ctx, anchor)
        ours = ours_block(again, target, ctx.numpy()[0], anchor, ref["prev"])
        for name in ("base", "corrected"):  # float32 sums over the real width: 1e-5 of the logits' scale
            np.testing.assert_allclose(ours[name], ref[name], err_msg=f"{source}: {name}", rtol=1e-4,
                                       atol=1e-5 * np.abs(ref[name]).max())
        np.testing.assert_array_equal(ours["tokens"], ref["tokens"], err_msg=f"{source}: greedy drafts")
        if ref["conf"] is not None:
            np.testing.assert_allclose(ours["conf_draft"], ref["conf"], err_msg=f"{source}: confidences", rtol=1e-4,
                                       atol=1e-4)


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_the_shipped_drafters_export_to_speculators_and_the_reference_loads_them(spec, target, smollm2_folder, name,
                                                                                   tmp_path):
    """The shipped SmolLM2 pair in the speculators format: exported, read back equal, loaded by the reference classes
    and drafting there as here."""
    check_shipped_round_trip(spec, target, smollm2_folder, name, tmp_path)


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_deepspec_refuses_the_shipped_reduced_vocabulary(name, tmp_path, capsys):
    """DeepSpec, which proposes from the full vocabulary only, refuses the shipped pair's 8192-token draft vocabulary
    by name, before any target loads, and writes nothing."""
    from dspark_jax import export

    with pytest.raises(SystemExit):
        export.main(["--format", "deepspec", name, str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "the deepspec format cannot hold this drafter" in err and "reduced draft vocabulary of 8192" in err, err
    assert not (tmp_path / "out").exists()


def _config(**over) -> dict:
    layers = dict(model_type="qwen3", hidden_size=D, vocab_size=V, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4)
    hf = dict(speculators_model_type="dspark", transformer_layer_config=layers, draft_vocab_size=V, block_size=G,
              aux_hidden_state_layer_ids=list(AUX), mask_token_id=MASK, markov_rank=8, sample_from_anchor=True)
    hf.update(over)
    return hf


@pytest.mark.parametrize("over, match", [
    (dict(speculators_model_type="eagle3"), r"'speculators_model_type' = 'eagle3': only speculators DSpark and "
                                            r"DFlash drafters are read \('dspark', 'dflash'\); DFlash2, Eagle3"),
    (dict(speculators_model_type="dflash2"), r"'speculators_model_type' = 'dflash2'"),
    (dict(sample_from_anchor=False), r"'sample_from_anchor' = false: slot 0"),
    (dict(sample_from_anchor="yes"), r"'sample_from_anchor' = 'yes', expected bool"),
    (dict(aux_hidden_state_layer_ids=[0, 2]), r"'aux_hidden_state_layer_ids' = \[0, 2\]: 0 \(the target's "
                                              r"embedding output\)"),
    (dict(aux_hidden_state_layer_ids=None), r"'aux_hidden_state_layer_ids' is missing"),
    (dict(draft_vocab_size=V + 1), r"'draft_vocab_size' = 321, expected 1..320"),
    (dict(mask_token_id=None), r"'mask_token_id' is missing or null"),
    (dict(target_hidden_size=128), r"'target_hidden_size' = 128"),
    (dict(markov_head_type="lstm"), r"'markov_head_type' = 'lstm'"),
    (dict(transformer_layer_config={"hidden_size": D}), r"'transformer_layer_config.num_attention_heads' is missing"),
])
def test_bad_config_fields_are_named(over, match):
    hf = {k: v for k, v in _config(**over).items() if v is not None}
    with pytest.raises(ValueError, match=match) as err:
        speculators_drafter_config(hf, "/x/config.json")
    assert "/x/config.json" in str(err.value)


def test_missing_fields_take_the_reference_defaults():
    """Absent fields read as speculators' config classes fill them in: a DFlash config's sample_from_anchor is
    false (refused), a DSpark config's Markov head is vanilla, rank 256, with a confidence head on W1."""
    dflash = {k: v for k, v in _config(speculators_model_type="dflash").items() if k != "sample_from_anchor"}
    with pytest.raises(ValueError, match="'sample_from_anchor' = false"):
        speculators_drafter_config(dflash, "/x/config.json")
    assert speculators_drafter_config({**dflash, "sample_from_anchor": True}).head == "none"
    dspark = {k: v for k, v in _config().items() if k not in ("markov_rank", "sample_from_anchor")}
    c = speculators_drafter_config(dspark)
    assert (c.head, c.rank, c.confidence, c.confidence_prev, c.block) == ("markov", 256, True, True, G)


def test_bad_folders_are_refused_before_weights_are_read(verifier, tmp_path, monkeypatch):
    """Layer ids beyond the target, a missing tensor, a vocabulary map that does not match draft_vocab_size and
    unequal Markov rows outside the draft vocabulary: each refused naming the file and the field or tensor; the
    first three before any weight is read (the weight reader is never reached)."""
    from safetensors.numpy import load_file, save_file

    from dspark_jax.models import speculators

    path, target = verifier
    save_speculators_drafter(exportable(draft_ids=DRAFT_IDS), tmp_path / "good", embed=target.weights.embed,
                             lm_head=target.weights.lm_head)
    good = tmp_path / "good"
    weights = load_file(good / "model.safetensors")
    hf = json.loads((good / "config.json").read_text())

    def folder(name, config=hf, tensors=weights):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    monkeypatch.setattr(speculators, "read_drafter", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match=r"aux_hidden_state_layer_ids = \[2, 3\] holds \[3\], but the target has 3 "
                                         r"layers: expected ids in \[1, 3\)"):
        load_speculators_drafter(folder("ids", {**hf, "aux_hidden_state_layer_ids": [2, 3]}), target.cfg)
    with pytest.raises(ValueError, match=r"weights lack \['markov_head.markov_w2.weight'\]"):
        load_speculators_drafter(folder("missing", tensors={k: v for k, v in weights.items() if "w2" not in k}))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'd2t' has shape \[95\], expected \[96\]"):
        load_speculators_drafter(folder("d2t", tensors={**weights, "d2t": weights["d2t"][:-1]}))
    t2d = weights["t2d"].copy()
    t2d[np.flatnonzero(~t2d)[0]] = True
    with pytest.raises(ValueError, match=r"tensor 't2d' marks 97 tokens, but draft_vocab_size is 96"):
        load_speculators_drafter(folder("t2d", tensors={**weights, "t2d": t2d}))
    monkeypatch.undo()
    no_head = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # speculators refills it from the verifier
    assert load_speculators_drafter(folder("no-head", tensors=no_head))[0].cfg.draft_vocab == len(DRAFT_IDS)
    w1 = weights["markov_head.markov_w1.weight"].copy()
    w1[np.flatnonzero(~weights["t2d"])[0]] += 1.0
    with pytest.raises(ValueError, match=r"tensor 'markov_head.markov_w1.weight'.*rows of the 224 tokens outside "
                                         r"the draft vocabulary differ"):
        load_speculators_drafter(folder("w1", tensors={**weights, "markov_head.markov_w1.weight": w1}))
    with pytest.raises(ValueError, match=r"'speculators_model_type' = 'eagle3'"):
        resolve_drafter(str(folder("eagle3", {**hf, "speculators_model_type": "eagle3"})))
    model = tmp_path / "qwen3-wide"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": 128, "num_hidden_layers": 36}))
    with pytest.raises(ValueError, match=r"good/config.json: hidden_size = 64, but the target's width"):
        precheck_for_model(str(good), model)


# ------------------------------------------------------------------------------------------------------------
# Through the engine


def test_generate_with_a_speculators_drafter_equals_plain_decoding(verifier, tmp_path):
    """`generate --draft SPECULATORS_FOLDER --policy dspark --temperature 0` (and fixed:3, which verifies drafts
    every round) gives `--policy none`'s tokens on a tiny Qwen3 checkpoint."""
    from dspark_jax import generate

    path, target = verifier
    save_speculators_drafter(exportable(draft_ids=DRAFT_IDS, seed=4, block=7), tmp_path / "spec",  # the packaged
                             embed=target.weights.embed, lm_head=target.weights.lm_head)  # SPS table's block
    common = ["--model", str(path), "--prompt", "hello there", "--max-new-tokens", "12", "--quiet", "--temperature",
              "0"]
    with pytest.warns(UserWarning):  # the packaged SPS table was measured for another model
        spec = generate.main(common + ["--policy", "dspark", "--draft", str(tmp_path / "spec")])
    fixed = generate.main(common + ["--policy", "fixed:3", "--draft", str(tmp_path / "spec")])
    plain = generate.main(common + ["--policy", "none"])
    for run in (spec, fixed):
        assert [r["output_ids"] for r in run["results"]] == [r["output_ids"] for r in plain["results"]]
    assert fixed["summary"]["drafts_per_request"] > 0 and len(plain["results"][0]["output_ids"]) == 12


def test_sampled_output_with_a_speculators_drafter_follows_the_target(tmp_path):
    """Temperature 1 with a speculators drafter proposing from 3 of 4 tokens: the output follows the target's
    exact law (chi-square)."""
    from tests.helpers import assert_follows_law
    from tests.test_deepspec import tiny_target
    from tests.test_engine import exact_joint

    target = tiny_target(vocab=4, seed=1, scale=0.15)
    save_speculators_drafter(exportable(vocab=4, draft_ids=np.array([0, 1, 2]), seed=5, dim=32, head_dim=8),
                             tmp_path / "d", embed=target.weights.embed, lm_head=target.weights.lm_head)
    drafter, _ = load_speculators_drafter(tmp_path / "d", target.cfg)
    prompt, m, n_req = [1, 2, 3, 1], 3, 600
    e = eng.Engine(target, drafter, "dspark", eng.EngineConfig(num_slots=8, capacity=32, temperature=1.0, seed=11),
                   sps=np.linspace(10, 4, 64).astype(np.float32), stop_ids=[])
    out = e.run([prompt] * n_req, m)
    assert_follows_law([c.output_ids for c in out], exact_joint(target, prompt, m, 4))
    assert e.summary()["drafts_per_request"] > 0


def test_docstring_examples():
    import doctest

    from dspark_jax.models import speculators

    result = doctest.testmod(speculators, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
