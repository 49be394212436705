"""Acceptance statistics of recorded rounds, and the evaluation path through the engine (tiny model)."""

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax import evaluation
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights


def test_acceptance_report_by_hand():
    accepted = np.array([0, 2, 3, 3, 1])
    verified = np.array([3, 3, 3, 3, 2])
    rep = evaluation.acceptance_report(accepted, verified, 3)
    assert rep["accept_len"] == np.mean(accepted + 1) and rep["rounds"] == 5
    s1, s2, s3 = (p["survival"] for p in rep["per_position"])
    assert s1 == 4 / 5 and s2 == 3 / 5 and s3 == 2 / 4  # position 3 is seen by the four rounds that verified 3
    c2 = rep["per_position"][1]["conditional"]
    assert c2 == 3 / 4  # of the rounds that accepted >= 1 and verified >= 2


def test_split_half():
    items = list(range(7))
    assert evaluation.split_half(items, "calib") == [0, 2, 4, 6]
    assert evaluation.split_half(items, "eval") == [1, 3, 5]


def test_fixed_block_rounds_record_everything():
    cfg = LlamaConfig.tiny()
    model = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0), scale=0.3), None)
    d = dr.Drafter(dr.DrafterConfig.for_target(cfg, n_layers=1, ffn_dim=16, rank=4, block=3), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=6).tolist() for _ in range(4)]
    rounds, _ = evaluation.fixed_block_rounds(model, d, prompts, max_new_tokens=10, temperature=1.0, concurrency=2)
    rep = evaluation.evaluate_rounds(rounds, 3, np.ones(3))
    assert rep["rounds"] == sum(r.active for r in rounds)
    assert all(r.confidence_logits.shape == (r.active, 3) for r in rounds)
    assert 1.0 <= rep["accept_len"] <= 4.0 and rep["ece_sts"] is not None


def test_summary_pools_ece_exactly_from_bins():
    """The README table's pooled ECE (merged reliability bins of per-domain reports) equals the ECE of the
    union of their rounds."""
    from dspark_jax import calibration
    from train.summarize_eval import pool

    rng = np.random.default_rng(3)
    parts = []
    for n, skew in ((500, 0.8), (1500, 1.3)):
        pred = rng.uniform(size=n)
        outcome = rng.uniform(size=n) < pred**skew
        parts.append((pred, outcome))
    reports = [{"rounds": len(p), "accept_len": 1.5, "auroc": 0.8, "per_position": [{"auroc_raw": 0.7}],
                "reliability_raw": calibration.reliability_bins(p, o), "reliability_sts": None} for p, o in parts]
    union = np.concatenate([p for p, _ in parts]), np.concatenate([o for _, o in parts])
    got = pool(reports)
    assert got["ece_raw"] == pytest.approx(float(calibration.ece(*union)), abs=1e-6)
    assert got["ece_sts"] is None and got["rounds"] == 2000


def test_half_per_file_limits_each_file_of_a_folder(tmp_path):
    """A folder of prompt files gives each file its own half and limit (a limit over the folder's joined list
    would evaluate only its first file)."""
    for name, n in (("a", 6), ("b", 5)):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"turns": ["{name}{i}"]}}\n' for i in range(n)))
    (tmp_path / "notes.txt").write_text("not a prompt file")
    chosen = evaluation.half_per_file([tmp_path], "eval", limit=2)
    assert [[p.turns[0] for p in c] for c in chosen] == [["a1", "a3"], ["b1", "b3"]]
    chosen = evaluation.half_per_file([tmp_path / "b.jsonl", tmp_path], "calib")
    assert [[p.turns[0] for p in c] for c in chosen] == [["b0", "b2", "b4"], ["a0", "a2", "a4"], ["b0", "b2", "b4"]]
    with pytest.raises(ValueError, match="neither a JSONL file nor a folder"):
        evaluation.half_per_file([tmp_path / "missing"], "eval")
    with pytest.raises(ValueError, match="half: expected"):
        evaluation.half_per_file([tmp_path], "odd")
