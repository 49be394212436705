"""Drafters that travel: `train.train_drafter --portable` (QK-norm, no per-tap norms, a mask token row), the
conversion of an existing drafter into that form (`heads.convert_drafter`, ``--init-from``), the choice of the
mask token, the export of the result in both formats and its reading back, and the pipeline's options."""

import dataclasses
import doctest
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import build, data, drafters, heads, training
from dspark_jax.models import drafter_files
from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
from tests.test_heads import write_cache
from tests.test_pipeline import args_for, fake_mains
from tests.test_training import TARGET, G, fake_cache
from train import pipeline, train_drafter

# The tiny target of `tests.test_training` with six layers, so that its five taps (0..4) are distinct layers below
# its last, as both formats record them; its embedding is the one the fake cache's log-partitions were made with.
TARGET6 = LlamaConfig.tiny(n_layers=6, tap_layers=(0, 1, 2, 3, 4))
TOKENIZER_SIZE = TARGET.vocab_size - 4  # the embedding has rows past the tokenizer's tokens: auto takes the first


def flat(module, what=nnx.Param) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.array(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, what))}


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """The six-layer tiny target (what the scripts load here), its cache on disk, a tap-norm DSpark drafter as the
    shipped ones are (learned mask vector, no QK-norm) with a reduced draft vocabulary."""
    w, cache = fake_cache()
    cache.tokens[cache.tokens >= TOKENIZER_SIZE] -= 8  # no text writes the rows past the tokenizer's tokens
    weights = init_random_weights(TARGET6, jax.random.key(1)).replace(embed=w.embed)
    tokenizer = types.SimpleNamespace(stop_ids=(0,), vocab_size=TOKENIZER_SIZE)
    target = LlamaModel(TARGET6, weights, tokenizer)
    load = lambda model=None, dtype=None, mesh=None: target  # noqa: E731
    monkeypatch.setattr(train_drafter, "load_target", load)
    monkeypatch.setattr(build, "load_target", load)  # the export's
    loader = data.BlockLoader  # one bucket that fits the fake sequences: one compiled step
    monkeypatch.setattr(data, "BlockLoader", lambda c, **kw: loader(c, **{**kw, "buckets": (32,)}))
    cfg = DrafterConfig.for_target(TARGET6, rank=4, block=G, n_layers=1, ffn_dim=16, tap_norm=True,
                                   draft_vocab_size=40)
    src = Drafter(cfg, rngs=nnx.Rngs(3), vocab_ids=np.r_[0:32, 40:48])
    src.w2.kernel[...] = 0.3 * jax.random.normal(jax.random.key(7), src.w2.kernel[...].shape)
    src.tap_scale[...] = jnp.linspace(0.5, 2.0, cfg.n_taps * cfg.dim).reshape(cfg.n_taps, cfg.dim)
    folder = drafter_files.save_drafter(src, tmp_path / "tapnorm", dtype=np.float32)
    return types.SimpleNamespace(tmp=tmp_path, target=target, cache=write_cache(cache, tmp_path / "cache"),
                                 raw=cache, src=folder)


def run_args(s, run="run", *extra):
    return ["--cache", str(s.cache), "--run", str(s.tmp / run), "--blocks", "8", "--context-tokens", "64",
            "--lr", "1e-2", "--steps", "2", *extra]


def test_portable_drafter_exports_to_both_formats_and_reads_back(setup, capsys):
    """A fresh --portable drafter: its export has QK-norm, no per-tap norms and the mask token auto picked (the
    first embedding row past the tokenizer's tokens here); `dspark_jax.export` writes it in both formats, and the
    speculators folder reads back through `drafters.resolve_drafter` with the same parameters. The same command
    resumes the finished run; the same folder without --portable is refused."""
    from dspark_jax import export

    s = setup
    args = run_args(s, "run", "--portable", "--layers", "1", "--ffn", "16", "--rank", "4", "--block", str(G))
    train_drafter.main(args)
    out = capsys.readouterr().out
    assert f"qk_norm=True, tap_norm=False, mask_token={TOKENIZER_SIZE} (row {TOKENIZER_SIZE}, the first" in out
    assert "portable: exports to speculators, deepspec" in out  # 64 tokens: the default vocabulary is the whole
    meta = json.loads((s.tmp / "run" / "export" / "config.json").read_text())
    cfg = meta["config"]
    assert cfg["qk_norm"] and not cfg["tap_norm"] and cfg["mask_token"] == TOKENIZER_SIZE
    assert "row 60" in meta["training"]["mask_token_choice"]
    ours, _ = drafter_files.load_drafter(s.tmp / "run" / "export")
    for fmt in ("speculators", "deepspec"):
        export.main(["--format", fmt, str(s.tmp / "run" / "export"), str(s.tmp / fmt)])
        back, back_meta, _, _ = drafters.resolve_drafter(str(s.tmp / fmt), target_cfg=TARGET6)
        assert back_meta["format"] == fmt and back.cfg.tap_layers == TARGET6.tap_layers
        want, have = flat(ours), flat(back)
        if fmt == "deepspec":  # DeepSpec stores the target's embedding and LM head: the drafter's own copies
            assert sorted(set(have) - set(want)) == ["embed", "lm_head"]
            np.testing.assert_array_equal(have["embed"], np.asarray(s.target.weights.embed))
        else:
            assert sorted(have) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(have[name], want[name], err_msg=f"{fmt}: {name}")
    train_drafter.main(args)  # resumes the finished run: nothing left to train
    with pytest.raises(ValueError, match="another configuration .*config differ"):
        train_drafter.main(run_args(s, "run", "--layers", "1", "--ffn", "16", "--rank", "4", "--block", str(G)))


def test_a_tap_norm_drafter_fine_tuned_into_a_portable_one(setup, capsys):
    """--init-from a drafter with per-tap norms and a learned mask vector, --portable --draft-vocab 0: stdout names
    the parameters started fresh (QK-norm scales), dropped (the per-tap scales, the mask vector) and adapted (the
    context projection, the heads' vocabulary); it trains, and its export is portable, of the full vocabulary."""
    s = setup
    train_drafter.main(run_args(s, "run", "--init-from", str(s.src), "--portable", "--draft-vocab", "0"))
    out = capsys.readouterr().out
    assert ("initialised fresh: layers/0/k_norm/scale, layers/0/q_norm/scale; dropped: mask_embed, tap_scale"
            in out), out
    assert "adapted ctx_proj/kernel: each tap's rows scaled by its dropped norm scale over its typical RMS" in out
    assert "adapted the draft vocabulary goes from 40 to 64 tokens (24 new; w1/embedding, w2/kernel follow" in out
    assert "adapted layers/*/q_norm/scale, layers/*/k_norm/scale: fitted to the source's queries and keys" in out
    meta = json.loads((s.tmp / "run" / "export" / "config.json").read_text())
    assert meta["training"]["dropped_params"] == ["mask_embed", "tap_scale"]
    assert {k: meta["config"][k] for k in ("qk_norm", "tap_norm", "mask_token", "draft_vocab_size")} == {
        "qk_norm": True, "tap_norm": False, "mask_token": TOKENIZER_SIZE, "draft_vocab_size": 0}
    rows = training.metric_rows(s.tmp / "run" / "metrics.jsonl")
    assert rows[-1]["step"] == 2 and np.isfinite(rows[-1]["loss"])
    record = json.loads((s.tmp / "run" / "run.json").read_text())
    assert record["init_from"] == str(s.src) and record["config"]["qk_norm"]
    # --mask-token auto keeps a portable source's own token; a conversion with a frozen backbone is refused
    train_drafter.main(run_args(s, "again", "--init-from", str(s.tmp / "run" / "export"), "--portable"))
    assert "initialised fresh: none; dropped: none" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_drafter.main(run_args(s, "heads", "--init-from", str(s.src), "--portable", "--train", "heads"))
    assert "--portable: converting the --init-from drafter changes its backbone" in capsys.readouterr().err


def test_conversion_keeps_what_maps(setup):
    """`heads.convert_drafter` of a tap-norm drafter into a portable one of the full vocabulary: layers and heads
    copied bit for bit, QK-norm scales at ones; the folded context projection gives the source's context features
    for taps at their typical RMS; the Markov embedding gives every previous token its old row (the shared
    out-of-vocabulary row for the new tokens), and w2's columns follow their tokens (zero for the new ones)."""
    s = setup
    src, _ = drafter_files.load_drafter(s.src)
    cfg = dataclasses.replace(src.cfg, qk_norm=True, tap_norm=False, mask_token=5, draft_vocab_size=0)
    rms = data.tap_rms(s.raw)
    assert rms.shape == (5,) and np.all(rms > 0)
    conv = heads.convert_drafter(src, cfg, vocab_ids=np.arange(TARGET6.vocab_size), tap_rms=rms)
    new, old = flat(conv.drafter), flat(src)
    assert conv.fresh == ["layers/0/k_norm/scale", "layers/0/q_norm/scale"]
    assert conv.dropped == ["mask_embed", "tap_scale"]
    for name in conv.fresh:
        np.testing.assert_array_equal(new[name], 1.0)
    for name in old:
        if name.startswith(("layers/", "conf/", "ctx_norm/", "final_norm/")):
            np.testing.assert_array_equal(new[name], old[name], err_msg=name)
    rng = np.random.default_rng(0)
    taps = rng.normal(size=(3, 5, TARGET6.dim)).astype(np.float32)
    taps *= (rms / np.sqrt(np.mean(taps * taps, -1)))[..., None]  # every tap at its typical RMS
    np.testing.assert_allclose(np.asarray(conv.drafter.context_features(jnp.asarray(taps))),
                               np.asarray(src.context_features(jnp.asarray(taps))), rtol=1e-3, atol=1e-4)
    tokens = jnp.arange(TARGET6.vocab_size)
    np.testing.assert_array_equal(np.asarray(conv.drafter.prev_embedding(tokens)),
                                  np.asarray(src.prev_embedding(tokens)))
    ids = np.asarray(src.vocab_ids[...])
    w2 = new["w2/kernel"]
    np.testing.assert_array_equal(w2[:, ids], old["w2/kernel"])
    assert not np.any(np.delete(w2, ids, axis=1))
    with pytest.raises(ValueError, match="differs from its source in n_layers"):
        heads.convert_drafter(src, dataclasses.replace(cfg, n_layers=2))


def block_hidden(drafter, batch, embed) -> np.ndarray:
    """The drafter's block hidden states on a `data.BlockBatch`, as the training loss computes them."""
    taps, tokens, anchors = jnp.asarray(batch.taps, jnp.float32), jnp.asarray(batch.tokens), jnp.asarray(batch.anchors)
    N, S = tokens.shape
    ctx_k, ctx_v = drafter.context_kv(taps, jnp.broadcast_to(jnp.arange(S), (N, S)))
    mask = jnp.arange(S)[None, None, :] < anchors[..., None]
    return np.asarray(drafter.hidden(ctx_k, ctx_v, mask, jnp.take_along_axis(tokens, anchors, axis=1), anchors, embed))


def test_fitted_qk_norm_scales_keep_the_drafter_closer_to_its_source(setup):
    """QK-norm switched on with `heads.fit_qk_norm_scales`' scales: the block hidden states stay nearer the source's
    than with scales of ones (which change every attention logit by the query's and key's RMS)."""
    s = setup
    src, _ = drafter_files.load_drafter(s.src)
    batch = data.BlockLoader(s.raw, block=G, blocks=8, context_tokens=64, seed=0).batch(0)
    embed = s.target.weights.embed
    scales = heads.fit_qk_norm_scales(src, batch, embed)
    assert scales.shape == (1, 2, TARGET6.head_dim) and np.all(np.isfinite(scales)) and np.all(scales > 0)
    cfg = dataclasses.replace(src.cfg, qk_norm=True)
    fitted = heads.convert_drafter(src, cfg, qk_scales=scales)
    np.testing.assert_array_equal(np.asarray(fitted.drafter.layers[0].k_norm.scale[...]), scales[0, 1])
    ones = heads.convert_drafter(src, cfg).drafter
    want = block_hidden(src, batch, embed)
    far = np.abs(block_hidden(ones, batch, embed) - want).mean()
    assert np.abs(block_hidden(fitted.drafter, batch, embed) - want).mean() < 0.1 * far


def test_choose_mask_token(gguf_path):
    """SmolLM2 (no mask token, every embedding row a token): the last code-metadata special token, <empty_output>
    (16), unless the training data hold it; a tokenizer with a mask token: that one."""
    from tokenizers import AddedToken, Tokenizer as Backend, models

    from dspark_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path)
    token, why = training.choose_mask_token(tok, 49152)
    assert token == 16 and "<empty_output>" in why
    seen = np.zeros(49152, np.int64)
    seen[16] = 3
    assert training.choose_mask_token(tok, 49152, seen)[0] == 15
    backend = Backend(models.BPE())
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>", "<mask>", "<x>")])
    masked = types.SimpleNamespace(backend=backend, vocab_size=5, bos_id=0, eos_id=1, pad_id=2, stop_ids=(1,))
    assert training.choose_mask_token(masked, 8) == (3, "the tokenizer's mask token '<mask>'")
    plain = types.SimpleNamespace(backend=backend, vocab_size=5, bos_id=0, eos_id=1, pad_id=2, stop_ids=(1,),
                                  chat_template="<x>{{ m }}")
    seen = np.zeros(5, np.int64)
    seen[3] = 1
    with pytest.raises(ValueError, match="name one with --mask-token ID"):
        training.choose_mask_token(plain, 5, seen)


def test_docstring_examples():
    result = doctest.testmod(training, extraglobs={"jnp": jnp}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_init_layers_of_a_qk_norm_drafter_from_a_target_without_it():
    """--portable --init-layers on a Llama target: the layers are copied, the QK-norm scales stay at ones."""
    w = init_random_weights(TARGET, jax.random.key(0))
    d = Drafter(DrafterConfig.for_target(TARGET, n_layers=1, block=G, qk_norm=True), rngs=nnx.Rngs(0))
    training.init_layers_from_target(d, w, [-1])
    np.testing.assert_array_equal(np.asarray(d.layers[0].wq.kernel[...]), np.asarray(w.layers[-1].wq))
    np.testing.assert_array_equal(np.asarray(d.layers[0].q_norm.scale[...]), 1.0)


def fail_if_reached(*a, **k):
    raise AssertionError("reached long work")


@pytest.mark.parametrize("extra, error", [
    (["--portable", "--tap-norm"], "--portable --tap-norm: neither export format holds per-tap norms"),
    (["--portable", "--no-qk-norm"], "--portable --no-qk-norm: both export formats' draft layers normalise"),
    (["--mask-token", "mask"], "argument --mask-token: expected a token id or 'auto', got 'mask'"),
    (["--init-from", "dflash", "--qk-norm", "--train", "heads"], "--qk-norm: converting the --init-from drafter"),
    (["--init-from", "dflash", "--validate-only", "--val-cache", "x", "--portable"],
     "--portable: --validate-only scores the --init-from drafter as it is"),
])
def test_conflicting_options_stop_before_any_work(tmp_path, monkeypatch, capsys, extra, error):
    monkeypatch.setattr(train_drafter, "load_target", fail_if_reached)
    monkeypatch.setattr(train_drafter.data, "open_target_cache", fail_if_reached)
    with pytest.raises(SystemExit):
        train_drafter.main(["--run", str(tmp_path / "r"), *extra])
    assert error in capsys.readouterr().err


def test_pipeline_passes_the_portable_recipe_and_exports(tmp_path, capsys):
    """train.pipeline --portable --init-from shipped --draft-vocab 0: both drafters start from their shipped
    namesakes with the same portable recipe, an export stage writes both formats (DeepSpec only for a drafter of
    the full vocabulary, saying so otherwise), and a resumed run with another portable recipe is refused."""
    calls = []
    mains = fake_mains(calls)
    fake_train = mains["train_drafter"]

    def train(argv):  # the export the stage would write: the dflash of a reduced vocabulary
        fake_train(argv)
        run = argv[argv.index("--run") + 1]
        cfg = {"vocab_size": 64, "draft_vocab_size": 0 if run.endswith("dspark") else 40}
        (tmp_path / run / "export").mkdir(parents=True)
        (tmp_path / run / "export" / "config.json").write_text(json.dumps({"config": cfg}))

    mains["train_drafter"] = train
    args = args_for(tmp_path, "--portable", "--init-from", "shipped", "--draft-vocab", "0", "--steps", "5")
    record = pipeline.run(args, mains, log=lambda m: None)
    trains = [argv for name, argv in calls if name == "train_drafter"]
    for kind, argv in zip(pipeline.DRAFTERS, trains):
        assert argv[argv.index("--init-from") + 1] == kind and "--portable" in argv
        assert argv[argv.index("--draft-vocab") + 1] == "0"
    exports = [argv for name, argv in calls if name == "export"]
    assert [(a[1], re.sub(r".*/", "", a[3])) for a in exports] == [
        ("speculators", "dspark-speculators"), ("deepspec", "dspark-deepspec"), ("speculators", "dflash-speculators")]
    assert "not written as DeepSpec, which holds the full vocabulary only" in capsys.readouterr().out
    assert record["settings"]["portable"] and record["settings"]["init_from"] == "shipped"
    with pytest.raises(SystemExit, match="portable"):
        pipeline.run(args_for(tmp_path, "--init-from", "shipped", "--draft-vocab", "0", "--steps", "5"),
                     fake_mains([]), log=lambda m: None)


@pytest.mark.parametrize("extra, match", [
    (["--portable", "--tap-norm"], "--portable --tap-norm: neither export format holds per-tap norms"),
    (["--init-from", "shipped", "--layers", "3"], "--layers: the architecture comes from --init-from shipped"),
    (["--init-from", "nowhere"], "--init-from nowhere: expected 'shipped' or an earlier pipeline's --out folder"),
    (["--mask-token", "x"], "--mask-token x: expected a token id or 'auto'"),
])
def test_pipeline_refuses_conflicting_options_before_work(tmp_path, capsys, extra, match):
    with pytest.raises(SystemExit):
        args_for(tmp_path, *extra)
    assert match in capsys.readouterr().err
