"""The shipped drafters: they load by name, match the target, stay small, and draft usefully and losslessly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dspark_jax.drafters import SHIPPED, resolve_drafter, shipped_dir

ASSET_LIMIT_MB = 40


def _shipped():
    return all((shipped_dir(n) / "config.json").is_file() for n in SHIPPED)


pytestmark = pytest.mark.skipif(not _shipped(), reason="the shipped drafters are not in this checkout")


def test_shipped_drafters_fit_the_budget():
    total = sum(f.stat().st_size for n in SHIPPED for f in Path(shipped_dir(n)).iterdir() if f.is_file())
    assert total <= ASSET_LIMIT_MB * 2**20, f"shipped drafters take {total / 2**20:.1f} MB"


def test_shipped_pair_differs_only_in_the_heads(target):
    ds, ds_meta, ds_temps, _ = resolve_drafter("dspark", target_cfg=target.cfg)
    df, df_meta, df_temps, _ = resolve_drafter("dflash", target_cfg=target.cfg)
    assert ds.cfg.head == "markov" and ds.cfg.confidence
    assert df.cfg.head == "none" and not df.cfg.confidence
    for field in ("n_layers", "ffn_dim", "dim", "n_heads", "n_kv_heads", "block", "draft_vocab_size"):
        assert getattr(ds.cfg, field) == getattr(df.cfg, field), field
    assert ds_meta["training"]["steps"] == df_meta["training"]["steps"]
    assert ds_meta["training"]["args"]["cache"] == df_meta["training"]["args"]["cache"]
    # STS temperatures, one per block position, fitted on dev rounds and shipped beside the weights: a set
    # for greedy rounds and one for sampled rounds (a draft survives by a different rule at each).
    assert ds_temps is not None and ds_temps.block == ds.cfg.block
    assert ds_temps.at.tolist() == [0.0, 1.0]
    assert np.all(np.isfinite(ds_temps.temperatures)) and np.all(ds_temps.temperatures > 0)


def test_profiler_times_the_shipped_drafter_shape():
    from dspark_jax.measure import SHIPPED_DRAFTER

    ds, _, _, _ = resolve_drafter("dspark")
    assert {k: getattr(ds.cfg, k) for k in SHIPPED_DRAFTER} == SHIPPED_DRAFTER


@pytest.mark.slow
def test_shipped_dspark_drafter_is_lossless_and_accepts(target):
    """Greedy decoding with the shipped drafter at a fixed block of 7 equals plain decoding, and the drafter
    earns its keep: more than one token per round on a plain arithmetic prompt."""
    from dspark_jax.decoding import plain_generate
    from dspark_jax.engine import Engine, EngineConfig

    drafter, _, temps, _ = resolve_drafter("dspark", target_cfg=target.cfg)
    prompts = [target.tokenizer.encode_chat(["What is 15 plus 27? Answer with a short explanation."]),
               target.tokenizer.encode_chat(["Write a Python function that returns the square of a number."])]
    plain, _ = plain_generate(target, prompts, 40, num_slots=2, warmup=False)
    engine = Engine(target, drafter, "fixed:7", EngineConfig(num_slots=2, capacity=256), sts_temperatures=temps)
    done = engine.run(prompts, 40)
    assert [c.output_ids for c in done] == [p.output_ids for p in plain]
    active = sum(r.active for r in engine.rounds)
    accept_len = sum(int(r.accepted.sum()) + r.active for r in engine.rounds) / active
    assert accept_len > 1.3, accept_len


def test_engine_prior_comes_from_the_drafters_calibration(tmp_path):
    """The gate of a fresh engine starts from the first draft's acceptance on the calibration rounds."""
    import json

    from dspark_jax.drafters import prior_confidence, shipped_dir

    report = json.loads((shipped_dir("dspark") / "calibration.json").read_text())
    assert prior_confidence(shipped_dir("dspark"), 0.7) == report["per_position"][0]["conditional"] < 0.7
    assert prior_confidence(tmp_path, 0.7) == 0.7  # no calibration report
    for bad in ({"per_position": []}, {"per_position": [{"conditional": 1.5}]}):
        (tmp_path / "calibration.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="per_position"):
            prior_confidence(tmp_path, 0.7)
