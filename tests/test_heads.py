"""Training part of a drafter on a frozen rest (heads, confidence head), the train / calibrate / evaluate
scripts' options and their errors on bad input, on tiny random configs."""

import doctest
import json
import re
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import data, drafters, heads, training
from dspark_jax.models import drafter_files
from dspark_jax.models.drafter import Buffer, Drafter, DrafterConfig
from dspark_jax.models.llama import LlamaConfig, LlamaModel
from tests.test_training import TARGET, G, fake_cache, loader_for, tiny_drafter
from train import calibrate, evaluate, train_drafter


def flat(module, what=nnx.Param) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.array(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, what))}


def test_doctests():
    for module in (heads, drafters):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_confidence_part_trains_only_the_confidence_head(tmp_path):
    w, cache = fake_cache()
    src = tiny_drafter()  # Markov + confidence heads, W2 not zero
    cfg = heads.head_config(src.cfg, part="confidence")
    assert cfg == src.cfg
    d, fresh = heads.extend_drafter(src, cfg)
    assert fresh == []
    before, buffers = flat(d), flat(d, Buffer)
    np.testing.assert_equal(before, flat(src))
    tc = training.TrainConfig(steps=3, lr=1e-2, log_every=3, ckpt_every=3)
    out = training.train(d, loader_for(cache), w.embed, None, tc=tc, loss_cfg=heads.loss_for("confidence"),
                         run_dir=tmp_path / "run", progress=False, trainable=heads.trainable_filter("confidence", cfg))
    after = flat(out)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == {"conf/kernel", "conf/bias"}  # the Markov head (w1, w2) and the backbone bit-identical
    np.testing.assert_equal(flat(out, Buffer), buffers)


def write_cache(cache, folder):
    """A `TargetCache` on disk in `data.build_target_cache`'s layout (one shard)."""
    folder.mkdir(parents=True)
    stem = folder / "chunk_00000"
    np.save(f"{stem}.tokens.npy", cache.tokens)
    np.save(f"{stem}.taps.npy", cache.taps.view(np.uint16))
    np.save(f"{stem}.final.npy", cache.final)
    np.save(f"{stem}.lse.npy", cache.lse)
    seqs = [{"index": i, "domain": "x", "prompt_length": int(p), "length": int(n)}
            for i, (p, n) in enumerate(zip(cache.prompt_lengths, cache.lengths))]
    index = {"shards": [{"shard": stem.name, "sequences": seqs}], "tap_layers": [0, 1, 2, 3, 4], "dim": TARGET.dim}
    (folder / "index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A tiny target (what the scripts' `load_target` returns here), its cache on disk, a DFlash-style source."""
    w, cache = fake_cache()
    target = LlamaModel(TARGET, w, types.SimpleNamespace(stop_ids=(0,)))
    monkeypatch.setattr(train_drafter, "load_target", lambda model=None, dtype=None, mesh=None: target)
    cache_dir = write_cache(cache, tmp_path / "cache")
    src = drafter_files.save_drafter(tiny_drafter(head="none", confidence=False), tmp_path / "dflash")
    return types.SimpleNamespace(tmp=tmp_path, target=target, cache=str(cache_dir), src=src)


def run_args(s, *extra):
    return ["--cache", s.cache, "--run", str(s.tmp / "run"), "--blocks", "8", "--context-tokens", "64",
            "--lr", "1e-2", *extra]


def test_heads_from_a_dflash_drafter_on_its_frozen_backbone(setup, monkeypatch):
    s = setup
    # One bucket that fits the fake sequences keeps the test to one compiled step.
    loader = data.BlockLoader
    monkeypatch.setattr(data, "BlockLoader", lambda cache, **kw: loader(cache, **{**kw, "buckets": (32,)}))
    args = run_args(s, "--init-from", str(s.src), "--train", "heads", "--rank", "4", "--steps", "3")
    train_drafter.main(args)
    export = s.tmp / "run" / "export"
    meta = json.loads((export / "config.json").read_text())
    assert meta["config"]["head"] == "markov" and meta["config"]["confidence"] and meta["config"]["rank"] == 4
    assert sorted(meta["training"]["new_params"]) == ["conf/bias", "conf/kernel", "w1/embedding", "w2/kernel"]
    old, new = dict(np.load(s.src / "weights.npz")), dict(np.load(export / "weights.npz"))
    for k, v in old.items():  # the backbone (float16 both times) is bit-identical
        np.testing.assert_array_equal(new[k], v, err_msg=k)
    assert np.any(new["w2/kernel"] != 0)  # the Markov head starts at zero and moved
    fresh, _ = heads.extend_drafter(drafter_files.load_drafter(s.src)[0], heads.head_config(
        drafter_files.load_drafter(s.src)[0].cfg, rank=4))
    init = {k: v.astype(np.float16) for k, v in flat(fresh).items()}
    for k in ("conf/kernel", "w1/embedding"):
        assert not np.array_equal(new[k], init[k]), k
    drafter, _, temps, _ = drafters.resolve_drafter(str(export), target_cfg=TARGET)
    assert drafter.cfg.head == "markov" and temps is None
    # The same command again resumes the finished run (nothing left to train); other options are refused.
    train_drafter.main(args)
    with pytest.raises(ValueError, match="another configuration.*train"):
        train_drafter.main(run_args(s, "--init-from", str(s.src), "--train", "all", "--rank", "4", "--steps", "3"))


def test_validate_only_scores_a_drafter_on_the_blocks_training_logged(setup, monkeypatch):
    """A trained run's last held-out row is reproduced by --validate-only of its export (float16 weights),
    a DFlash drafter is scored as itself (no heads added), and nothing is trained (no training cache is read)."""
    s = setup
    loader = data.BlockLoader
    monkeypatch.setattr(data, "BlockLoader", lambda cache, **kw: loader(cache, **{**kw, "buckets": (32,)}))
    train_drafter.main(run_args(s, "--layers", "1", "--ffn", "16", "--rank", "4", "--steps", "2",
                                "--val-cache", s.cache, "--val-every", "2"))
    rows = [json.loads(x) for x in (s.tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    monkeypatch.setattr(train_drafter.training, "train", fail_if_reached)
    val = train_drafter.main(["--cache", str(s.tmp / "absent"), "--run", str(s.tmp / "val"), "--val-cache", s.cache,
                              "--init-from", str(s.tmp / "run" / "export"), "--validate-only"])
    np.testing.assert_allclose(val["val_tau_prob"], rows[-1]["val_tau_prob"], rtol=1e-3)
    np.testing.assert_allclose(val["val_loss"], rows[-1]["val_loss"], rtol=1e-2)
    assert json.loads((s.tmp / "val" / "validation.json").read_text())["val_tau_prob"] == val["val_tau_prob"]
    flash = train_drafter.main(["--run", str(s.tmp / "val2"), "--val-cache", s.cache,
                                "--init-from", str(s.src), "--validate-only"])
    assert 1.0 <= flash["val_tau_prob"] <= 1.0 + G


def test_init_layers_start_from_the_target_layers(setup, monkeypatch):
    """--init-layers: the drafter's layers and final norm start as the named target layers (the first step's
    checkpoint is one Adam step away from them), and the run records the option; a bad index or an FFN width
    the target's layers do not have stops before training."""
    s = setup
    loader = data.BlockLoader
    monkeypatch.setattr(data, "BlockLoader", lambda cache, **kw: loader(cache, **{**kw, "buckets": (32,)}))
    captured = {}

    def capture(drafter, *a, **k):
        captured["d"] = drafter
        return drafter

    monkeypatch.setattr(train_drafter.training, "train", capture)
    monkeypatch.setattr(train_drafter, "plot_training", lambda *a, **k: None)
    (s.tmp / "run").mkdir()
    (s.tmp / "run" / "metrics.jsonl").write_text('{"tau_prob": 1.0}\n')
    train_drafter.main(run_args(s, "--layers", "1", "--rank", "4", "--steps", "1", "--init-layers", "-1"))
    d, last = captured["d"], s.target.weights.layers[-1]
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(getattr(d.layers[0], name).kernel[...]), np.asarray(getattr(last, name)))
    np.testing.assert_array_equal(np.asarray(d.layers[0].attn_norm.scale[...]), np.asarray(last.attn_norm))
    np.testing.assert_array_equal(np.asarray(d.final_norm.scale[...]), np.asarray(s.target.weights.final_norm))
    # the context starts as the deepest tap, normalised as the copied layer's input: its keys are the layer's own
    taps = np.random.default_rng(0).normal(size=(3, d.cfg.n_taps, d.cfg.dim)).astype(np.float32)
    h = taps[:, -1]
    h = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + d.cfg.norm_eps) * np.asarray(last.attn_norm)
    np.testing.assert_allclose(np.asarray(d.layers[0].wk(d.context_features(jnp.asarray(taps)))),
                               h @ np.asarray(last.wk), rtol=1e-4, atol=1e-5)
    record = json.loads((s.tmp / "run" / "run.json").read_text())
    assert record["init_layers"] == [-1] and record["init_context"]
    with pytest.raises(ValueError, match=r"--init-layers 7: init layers \[7\]: the target has layers 0\.\.1"):
        train_drafter.main(run_args(s, "--run", str(s.tmp / "r2"), "--layers", "1", "--init-layers", "7"))
    with pytest.raises(ValueError, match="w_gate has shape .* build the drafter at the target's width and FFN"):
        train_drafter.main(run_args(s, "--run", str(s.tmp / "r3"), "--layers", "1", "--ffn", "16",
                                    "--init-layers", "0"))


def fail_if_reached(*a, **k):
    raise AssertionError("reached long work")


@pytest.mark.parametrize("extra, error", [
    (["--train", "everything"], "invalid choice: 'everything'"),
    (["--train", "heads"], "--train heads trains part of an existing drafter"),
    (["--init-from", "dflash", "--layers", "3"], "--layers: the architecture comes from --init-from"),
    (["--kind", "dflash", "--head", "rnn"], "--head: a DFlash drafter has no sequential head"),
    (["--validate-only", "--init-from", "dflash"], "--validate-only: name the drafter with --init-from and the held"),
    (["--init-layers", "-1"], "--init-layers -1: expected one target layer per drafter layer (2)"),
    (["--init-from", "dflash", "--init-layers", "-1"], "--init-layers: the architecture comes from --init-from"),
    (["--no-init-context"], "--no-init-context: only with --init-layers"),
])
def test_bad_options_stop_at_parsing(setup, monkeypatch, capsys, extra, error):
    monkeypatch.setattr(train_drafter, "load_target", fail_if_reached)
    with pytest.raises(SystemExit):
        train_drafter.main(run_args(setup, *extra))
    assert error in capsys.readouterr().err


def test_bad_inputs_fail_before_training(setup, monkeypatch, capsys):
    s = setup
    monkeypatch.setattr(train_drafter.training, "train", fail_if_reached)
    with pytest.raises(SystemExit):  # a parser error, before the target loads
        train_drafter.main(run_args(s, "--init-from", str(s.tmp / "missing"), "--train", "heads"))
    assert re.search("--init-from .*missing: expected one of", capsys.readouterr().err)
    wide_cfg = LlamaConfig.tiny(dim=48)
    other = drafter_files.save_drafter(Drafter(DrafterConfig.for_target(wide_cfg, n_layers=1, ffn_dim=16, rank=4),
                                          rngs=nnx.Rngs(0)), s.tmp / "other")
    with pytest.raises(ValueError, match=r"--init-from .*other.*hidden_size = 48, but the target's width \(hidden_size\) is 32"):
        train_drafter.main(run_args(s, "--init-from", str(other), "--train", "heads"))
    with pytest.raises(ValueError, match="--train confidence keeps the sequential head frozen.*no sequential"):
        train_drafter.main(run_args(s, "--init-from", str(s.src), "--train", "confidence"))
    markov = drafter_files.save_drafter(tiny_drafter(), s.tmp / "markov")
    with pytest.raises(ValueError, match="--head rnn: the source drafter has a trained markov head"):
        train_drafter.main(run_args(s, "--init-from", str(markov), "--train", "heads", "--head", "rnn"))
    with pytest.raises(ValueError, match="--rank 8: the source drafter's Markov embedding has rank 4"):
        train_drafter.main(run_args(s, "--init-from", str(markov), "--train", "heads", "--rank", "8"))
    with pytest.raises(ValueError, match="--kind dflash: the source drafter has a markov"):
        train_drafter.main(run_args(s, "--init-from", str(markov), "--kind", "dflash"))
    wide = types.SimpleNamespace(cfg=wide_cfg)  # the cache is checked against the target before any weight is used
    monkeypatch.setattr(train_drafter, "load_target", lambda model=None, dtype=None, mesh=None: wide)
    with pytest.raises(ValueError, match=r"--cache .*\(taps, width\) = \(5, 32\), but the target has \(5, 48\)"):
        train_drafter.main(run_args(s, "--init-from", str(markov), "--train", "heads"))


def test_calibrate_never_writes_into_the_package(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(calibrate, "load_target", fail_if_reached)

    def refused(argv, pattern):  # a parser error (status 2) naming the problem, before the model loads
        with pytest.raises(SystemExit) as e:
            calibrate.main(argv)
        assert e.value.code == 2 and re.search(pattern, capsys.readouterr().err)

    refused(["--draft", "dspark"], "--draft dspark: the drafter lives in the installed package.*--out")
    inside = drafters.shipped_dir("dspark").parent / "mine"
    refused(["--draft", "dflash", "--out", str(inside)], "--out .*mine: lies inside the installed package")
    assert not inside.exists()
    refused(["--draft", str(tmp_path)], f"--draft {re.escape(str(tmp_path))}: expected one of")  # not a drafter
    # prompts are checked before the model loads
    refused(["--draft", "dflash", "--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "nothing.jsonl")],
            "prompts: .*nothing.jsonl is neither")


@pytest.mark.parametrize("script, extra", [(calibrate, ["--draft", "dflash", "--out", "x"]), (evaluate, [])])
def test_scripts_load_the_named_model(monkeypatch, tmp_path, script, extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n{"turns": ["ho"]}\n')
    (tmp_path / "m.gguf").write_bytes(b"")  # --model must name a file that exists; the loader is replaced
    seen = {}

    def load(model=None, dtype=None, mesh=None):
        seen.update(model=model, dtype=dtype)
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "load_target", load)
    with pytest.raises(KeyboardInterrupt):
        script.main([*extra, "--prompts", str(prompts), "--model", str(tmp_path / "m.gguf"), "--dtype", "bfloat16"])
    assert seen == {"model": str(tmp_path / "m.gguf"), "dtype": "bfloat16"}


def test_copy_drafter_adds_the_calibration_atomically(tmp_path):
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [1.0, 2.0, 0.5, 1, 1, 1, 1]}))
    out = drafters.copy_drafter(drafters.shipped_dir("dflash"), tmp_path / "cal", attach=[sts])
    for name in ("config.json", "weights.npz"):
        assert (out / name).read_bytes() == (drafters.shipped_dir("dflash") / name).read_bytes()
    assert (out / "sts.json").read_bytes() == sts.read_bytes()  # where resolve_drafter looks for it
    drafters.copy_drafter(drafters.shipped_dir("dflash"), out)  # replaces a drafter folder
    assert not (out / "sts.json").exists()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes exists and is not a drafter folder"):
        drafters.copy_drafter(drafters.shipped_dir("dflash"), tmp_path / "notes")


def test_calibrate_fits_a_set_per_temperature_and_the_engine_reads_them(setup, monkeypatch):
    """`train.calibrate --temperatures 0 1` decodes the calibration half at each temperature and writes both
    sets; loading the folder gives `STSSets` at [0, 1], and calibration.json's top report is the T = 1 one."""
    s = setup
    folder = drafter_files.save_drafter(tiny_drafter(), s.tmp / "dspark")
    prompts = s.tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(6)))
    monkeypatch.setattr(calibrate, "load_target", lambda model=None, dtype=None, mesh=None: s.target)
    rng = np.random.default_rng(0)
    monkeypatch.setattr(calibrate, "encode_first_turns", lambda tok, chosen, limit: [
        rng.integers(1, TARGET.vocab_size, size=5).tolist() for c in chosen for _ in c])
    calibrate.main(["--draft", str(folder), "--prompts", str(prompts), "--max-new-tokens", "12",
                    "--concurrency", "2", "--temperatures", "1", "0"])
    _, _, sets, _ = drafters.resolve_drafter(str(folder), target_cfg=TARGET)
    assert sets.at.tolist() == [0.0, 1.0] and sets.temperatures.shape == sets.biases.shape == (2, G)
    report = json.loads((folder / "calibration.json").read_text())
    assert report["temperature"] == 1.0 and [e["temperature"] for e in report["sets"]] == [0.0, 1.0]
    assert report["sets"][1]["temperatures"] == report["temperatures"]
    assert all("reliability_sts" in e for e in report["sets"])
    with pytest.raises(SystemExit):  # a parser error naming the option
        calibrate.main(["--draft", str(folder), "--prompts", str(prompts), "--temperatures", "-1"])


def test_a_run_started_before_a_config_field_existed_resumes(tmp_path):
    """check_resume fills config fields missing from an older run.json with their defaults; a real difference
    is still refused, naming it."""
    cfg = DrafterConfig.for_target(TARGET, n_layers=1, block=G)
    record = {"kind": "dspark", "config": cfg.to_dict(), "seed": 0}
    older = {**record, "config": {k: v for k, v in cfg.to_dict().items() if k != "tap_norm"}}
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "run.json").write_text(json.dumps(older))
    train_drafter.check_resume(tmp_path, record)
    with pytest.raises(ValueError, match="config differ"):
        train_drafter.check_resume(tmp_path, {**record, "config": {**cfg.to_dict(), "tap_norm": True}})
    # a run from before the bucket field used (256, 512, 1024): it resumes on those, a longer set is refused
    assert train_drafter.resumed_buckets(tmp_path) == [256, 512, 1024]
    assert train_drafter.resumed_buckets(tmp_path / "new") is None  # a new run: the loader's default buckets
    train_drafter.check_resume(tmp_path, {**record, "buckets": [256, 512, 1024]})
    with pytest.raises(ValueError, match="buckets differ"):
        train_drafter.check_resume(tmp_path, {**record, "buckets": [256, 512, 1024, 1536]})
    # fields recorded since: unchecked against a run that lacks them, checked against one that has them
    since = {"steps": 100, "data_parallel": 1, "data": {"sequences": 9, "tokens": 900}, "draft_vocab": "ab12"}
    train_drafter.check_resume(tmp_path, {**record, **since})
    (tmp_path / "run.json").write_text(json.dumps({**record, **since}))
    train_drafter.check_resume(tmp_path, {**record, **since})
    for key, value in (("steps", 200), ("data_parallel", 2), ("data", {"sequences": 10, "tokens": 950}),
                       ("draft_vocab", "cd34")):
        with pytest.raises(ValueError, match=f"{key} differ"):
            train_drafter.check_resume(tmp_path, {**record, **since, key: value})
