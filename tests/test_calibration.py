"""STS on synthetic miscalibrated data recovers the truth; metrics against NumPy."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import calibration as cal


def synthetic_rounds(n=40000, g=5, seed=0, true_temps=(2.0, 0.6, 3.0, 1.5, 2.5)):
    """Confidence logits whose calibrated values are sigmoid(logit / T_k): draws the acceptance chain
    from the true conditional probabilities, so the true temperatures are known."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.5, 1.5, size=(n, g)).astype(np.float32)
    p_true = 1 / (1 + np.exp(-logits / np.asarray(true_temps)[None, :g]))
    accept = rng.uniform(size=(n, g)) < p_true
    accepted = np.argmin(np.concatenate([accept, np.zeros((n, 1), bool)], 1), axis=1)  # leading True count
    verified = np.full(n, g)
    return logits, accepted, verified, np.asarray(true_temps[:g])


def test_sts_recovers_true_temperatures():
    logits, accepted, verified, truth = synthetic_rounds()
    temps = cal.fit_sts(logits, accepted, verified)
    # Early positions, where most rounds survive, pin their temperature down to a grid step or two.
    np.testing.assert_allclose(np.log2(temps[:2]), np.log2(truth[:2]), atol=0.21)
    # Everywhere, the calibrated survival is close to the true survival probability.
    a_true = np.cumprod(1 / (1 + np.exp(-logits / truth[None, :])), axis=1)
    a_sts = np.asarray(cal.survival_from_logits(logits, temps))
    a_raw = np.asarray(cal.survival_from_logits(logits, np.ones(5)))
    err_sts, err_raw = np.abs(a_sts - a_true).mean(), np.abs(a_raw - a_true).mean()
    assert err_sts < 0.02 and err_sts < err_raw / 3, (err_sts, err_raw)
    report = cal.calibration_report(logits, accepted, verified, temps)
    assert report["ece_raw"] > 0.025
    assert report["ece_sts"] < 0.01


def test_sts_handles_partially_verified_rounds():
    logits, accepted, verified, truth = synthetic_rounds(seed=1)
    rng = np.random.default_rng(2)
    verified = rng.integers(0, 6, size=len(verified))
    accepted = np.minimum(accepted, verified)
    temps = cal.fit_sts(logits, accepted, verified)
    np.testing.assert_allclose(np.log2(temps[:2]), np.log2(truth[:2]), atol=0.31)
    report = cal.calibration_report(logits, accepted, verified, temps)
    assert report["per_position"][4]["n"] < report["per_position"][0]["n"]
    assert report["ece_sts"] < report["ece_raw"]


def test_ece_brier_against_numpy():
    rng = np.random.default_rng(3)
    p = rng.uniform(size=1000)
    y = rng.uniform(size=1000) < p ** 2
    w = rng.uniform(size=1000) < 0.8
    idx = np.minimum((p * 20).astype(int), 19)
    num = sum(abs((p[w & (idx == b)]).sum() - y[w & (idx == b)].sum()) for b in range(20))
    np.testing.assert_allclose(float(cal.ece(p, y, w)), num / w.sum(), rtol=1e-4)
    np.testing.assert_allclose(float(cal.brier(p, y, w)), np.mean((p[w] - y[w]) ** 2), rtol=1e-4)


def test_auroc_against_pairwise_count():
    rng = np.random.default_rng(4)
    p = np.round(rng.uniform(size=300), 1)  # many ties
    y = rng.uniform(size=300) < p
    pos, neg = p[y], p[~y]
    want = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    np.testing.assert_allclose(cal.auroc(p, y), want, rtol=1e-12)
    assert np.isnan(cal.auroc(p, np.ones_like(y)))


def test_temperature_file_round_trip(tmp_path):
    cal.save_temperatures(tmp_path / "sts.json", [0.5, 1.0], {"rounds": 3})
    np.testing.assert_allclose(cal.load_temperatures(tmp_path / "sts.json"), [0.5, 1.0])
    (tmp_path / "bad.json").write_text('{"temperatures": [0, 1]}')
    with pytest.raises(ValueError, match="positive"):
        cal.load_temperatures(tmp_path / "bad.json")


def test_sts_sets_pick_the_nearest_fitted_temperature():
    sets = cal.STSSets.of({1.0: [2.0, 3.0], 0.0: [0.5, 0.75], 0.5: [1.0, 1.0]})
    assert sets.at.tolist() == [0.0, 0.5, 1.0]
    rows = cal.sts_for_rows(sets.at, sets.temperatures, jnp.array([0.0, 0.2, 0.25, 0.3, 0.9, 2.0]))
    assert np.asarray(rows).tolist() == [[0.5, 0.75], [0.5, 0.75], [0.5, 0.75], [1.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    one = cal.STSSets.of([1.5, 2.5])  # one set serves every temperature
    assert one.for_temperature(0.0).tolist() == one.for_temperature(3.0).tolist() == [1.5, 2.5]
    with pytest.raises(ValueError, match="same length"):
        cal.STSSets.of({0.0: [1.0], 1.0: [1.0, 2.0]})
    with pytest.raises(ValueError, match="ascending and distinct"):
        cal.STSSets(np.array([1.0, 0.0]), np.ones((2, 2)))
    with pytest.raises(ValueError, match="positive"):
        cal.STSSets.of({0.0: [1.0, -1.0]})


def test_sts_sets_file_round_trip_and_single_set_files(tmp_path):
    sets = cal.STSSets.of({0.0: [0.5, 1.0], 1.0: [2.0, 4.0]})
    cal.save_sts(tmp_path / "sts.json", sets, [{"rounds": 3}, {"rounds": 5}])
    back = cal.load_sts(tmp_path / "sts.json")
    assert back.at.tolist() == [0.0, 1.0] and back.temperatures.tolist() == [[0.5, 1.0], [2.0, 4.0]]
    np.testing.assert_allclose(cal.load_temperatures(tmp_path / "sts.json"), [2.0, 4.0])  # the highest set
    obj = json.loads((tmp_path / "sts.json").read_text())
    assert [s["rounds"] for s in obj["sets"]] == [3, 5]
    cal.save_temperatures(tmp_path / "old.json", [0.5, 1.0], {"temperature": 0.0})  # a file of one set
    old = cal.load_sts(tmp_path / "old.json")
    assert old.at.tolist() == [0.0] and old.temperatures.tolist() == [[0.5, 1.0]]
    (tmp_path / "bad.json").write_text('{"sets": [{"temperature": 0, "temperatures": [1]}, '
                                       '{"temperature": 1, "temperatures": [1, 2]}]}')
    with pytest.raises(ValueError, match="different lengths"):
        cal.load_sts(tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text('{"sets": [{"temperatures": [1]}]}')
    with pytest.raises(ValueError, match="numeric 'temperature'"):
        cal.load_sts(tmp_path / "bad2.json")


def test_offsets_recover_a_head_that_reads_too_high_on_both_sides_of_one_half():
    """True survival sigmoid(logit / T + b) with b < 0: every confidence reads too high, below 0.5 as well as
    above, which no temperature mends; the fitted offsets do, and plain STS stays the offset-free special case."""
    rng = np.random.default_rng(5)
    n, g = 40000, 3
    truth_t, truth_b = np.array([1.5, 0.8, 1.0]), np.array([-1.0, -0.5, 0.0])
    logits = rng.normal(0.0, 2.0, size=(n, g)).astype(np.float32)
    accept = rng.uniform(size=(n, g)) < 1 / (1 + np.exp(-(logits / truth_t + truth_b)))
    accepted = np.argmin(np.concatenate([accept, np.zeros((n, 1), bool)], 1), axis=1)
    verified = np.full(n, g)
    plain = cal.fit_sts(logits, accepted, verified)
    temps, offsets = cal.fit_sts_bias(logits, accepted, verified)
    np.testing.assert_allclose(offsets[:2], truth_b[:2], atol=0.16)
    np.testing.assert_allclose(np.log2(temps[0]), np.log2(truth_t[0]), atol=0.21)
    with_b = cal.calibration_report(logits, accepted, verified, temps, offsets)
    without = cal.calibration_report(logits, accepted, verified, plain)
    assert with_b["ece_sts"] < 0.01 < without["ece_sts"], (with_b["ece_sts"], without["ece_sts"])
    assert with_b["biases"] == [float(b) for b in offsets]
    # one offset grid point, zero: the temperatures alone, exactly as fit_sts
    t0, b0 = cal.fit_sts_bias(logits, accepted, verified, bias_grid=(0.0,))
    assert t0.tolist() == plain.tolist() and b0.tolist() == [0.0] * g


def test_sts_sets_carry_offsets_through_rows_and_files(tmp_path):
    sets = cal.STSSets(np.array([0.0, 1.0]), np.array([[0.5, 1.0], [2.0, 4.0]]), np.array([[-1.0, 0.5], [0.0, 0.0]]))
    assert sets.biases_for_temperature(0.2).tolist() == [-1.0, 0.5]
    assert sets.biases_for_temperature(0.9).tolist() == [0.0, 0.0]
    assert cal.STSSets.of({0.0: [1.0, 2.0]}).biases.tolist() == [[0.0, 0.0]]  # plain STS: zero offsets
    conf = cal.apply_sts(jnp.array([[2.0, 2.0]]), jnp.asarray(sets.for_temperature(0.0)),
                         jnp.asarray(sets.biases_for_temperature(0.0)))
    np.testing.assert_allclose(np.asarray(conf)[0], 1 / (1 + np.exp(-np.array([2 / 0.5 - 1.0, 2 / 1.0 + 0.5]))),
                               rtol=1e-6)
    cal.save_sts(tmp_path / "sts.json", sets)
    obj = json.loads((tmp_path / "sts.json").read_text())
    assert "biases" in obj["sets"][0] and "biases" not in obj["sets"][1]  # written only where a set has any
    back = cal.load_sts(tmp_path / "sts.json")
    assert back.biases.tolist() == [[-1.0, 0.5], [0.0, 0.0]]
    assert back.temperatures.tolist() == sets.temperatures.tolist()
    with pytest.raises(ValueError, match="offsets"):
        cal.STSSets(np.array([0.0]), np.ones((1, 2)), np.ones((1, 3)))
    (tmp_path / "bad.json").write_text('{"sets": [{"temperature": 0, "temperatures": [1, 2], "biases": [0]}]}')
    with pytest.raises(ValueError, match=r"sets\[0\]\.biases: expected 2 finite numbers"):
        cal.load_sts(tmp_path / "bad.json")


def test_fit_sts_names_inconsistent_rounds():
    logits = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"accepted: expected int \[N\] = \[3\]"):
        cal.fit_sts(logits, accepted=[1, 0], verified=[2, 2, 2])
    with pytest.raises(ValueError, match=r"round 1: expected 0 <= accepted <= verified <= G = 2"):
        cal.fit_sts(logits, accepted=[1, 2, 0], verified=[2, 1, 2])
    bad = logits.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"conf_logits: expected finite logits, round 2"):
        cal.fit_sts(bad, accepted=[1, 0, 0], verified=[2, 2, 2])


def test_positions_no_round_verified_keep_the_heads_confidence():
    """Rounds collected under a scheduler may never verify the late positions: every candidate scores ECE 0 there,
    so the fit must not pick the grid's sharpest temperature (which would make those drafts look certain)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 4)).astype(np.float32)
    verified = np.where(np.arange(64) % 2 == 0, 1, 2)  # positions 3 and 4 never verified
    accepted = np.minimum(rng.integers(0, 3, size=64), verified)
    temps = cal.fit_sts(logits, accepted, verified)
    temps_b, offsets = cal.fit_sts_bias(logits, accepted, verified)
    assert temps[2:].tolist() == [1.0, 1.0] and temps_b[2:].tolist() == [1.0, 1.0] and offsets[2:].tolist() == [0, 0]
    assert temps[0] != 1.0 or temps[1] != 1.0  # the observed positions are still fitted
    # equally good candidates: the temperature nearest 1 (here every temperature scores the same on constant logits)
    flat = np.zeros((8, 1), np.float32)
    assert cal.fit_sts(flat, accepted=[1, 0] * 4, verified=[1] * 8).tolist() == [1.0]


def test_apply_sts_and_sets_name_mismatched_shapes():
    with pytest.raises(ValueError, match=r"temperatures: expected \[\.\.\., G\] with G = 3"):
        cal.apply_sts(jnp.zeros((2, 3)), jnp.ones((2,)))
    with pytest.raises(ValueError, match=r"expected at \[K\] and temperatures \[K, G\]"):
        cal.sts_for_rows(jnp.array([0.0, 1.0, 2.0]), jnp.ones((2, 3)), jnp.zeros((1,)))
    with pytest.raises(ValueError, match=r"sampling_temperature: expected \[R\]"):
        cal.sts_for_rows(jnp.array([0.0, 1.0]), jnp.ones((2, 3)), jnp.float32(0.5))
