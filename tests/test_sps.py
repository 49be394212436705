"""SPS tables: round trip, validation, interpolation and envelope on synthetic points."""

import json
import os
import warnings

import numpy as np
import pytest

from dspark_jax import scheduler
from dspark_jax.sps import SPSMetadata, SPSPoint, SPSTable


def table(batch=(1, 8, 32, 128), sps=(20.0, 19.0, 12.0, 4.0), spread=None, **meta):
    return SPSTable.from_arrays(batch, sps, spread, SPSMetadata(**meta))


def test_round_trip(tmp_path):
    t = table(spread=(0.1, 0.2, 0.3, 0.4), device_kind="cpu", backend="cpu", model="m", dtype="float32",
              context_length=256, date="2026-11-29", extra={"repeats": 5})
    path = tmp_path / "t.json"
    t.save(path)
    assert SPSTable.load(path) == t
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_from_arrays_sorts():
    t = table(batch=(32, 1, 8), sps=(12.0, 20.0, 19.0))
    np.testing.assert_array_equal(t.batch_tokens, [1, 8, 32])
    np.testing.assert_array_equal(t.steps_per_s, [20.0, 19.0, 12.0])


@pytest.mark.parametrize(
    "points,match",
    [
        ((), "at least one"),
        ((SPSPoint(0, 1.0),), "integer >= 1"),
        ((SPSPoint(4, 1.0), SPSPoint(4, 2.0)), "strictly increasing"),
        ((SPSPoint(1, 0.0),), "finite and > 0"),
        ((SPSPoint(1, float("nan")),), "finite and > 0"),
        ((SPSPoint(1, 1.0, -1.0),), "spread"),
    ],
)
def test_validation_errors(points, match):
    with pytest.raises(ValueError, match=match):
        SPSTable(points)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="file not found"):
        SPSTable.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        SPSTable.load(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format"):
        SPSTable.load(bad)
    obj = table().to_json()
    obj["points"][1]["steps_per_s"] = -3
    bad.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"B=8\): steps_per_s must be finite and > 0"):
        SPSTable.load(bad)
    obj = table().to_json()
    obj["metadata"]["colour"] = "red"
    bad.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="unknown metadata"):
        SPSTable.load(bad)


def test_save_to_missing_folder_is_clear(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        table().save(tmp_path / "nope" / "t.json")


def test_linear_interpolation_of_step_time():
    t = table(batch=(2, 6), sps=(10.0, 2.0))
    dense = t.to_dense()
    assert dense.shape == (7,) and dense.dtype == np.float32
    # step time 0.1 at B<=2, 0.5 at 6, linear in between
    want_t = np.array([0.1, 0.1, 0.1, 0.2, 0.3, 0.4, 0.5])
    np.testing.assert_allclose(1 / dense, want_t, rtol=1e-6)


def test_ceil_interpolation_is_bucket_cost():
    t = table(batch=(2, 6), sps=(10.0, 2.0))
    np.testing.assert_allclose(t.to_dense(interpolation="ceil"), [10, 10, 10, 2, 2, 2, 2], rtol=1e-6)


def test_envelope_makes_step_time_monotone():
    t = table(batch=(1, 4, 8, 16), sps=(10.0, 5.0, 6.0, 1.0))  # B=8 measured faster than B=4
    raw = t.to_dense()
    env = t.to_dense(envelope=True)
    assert np.any(np.diff(raw) > 0)
    assert np.all(np.diff(env) <= 0)
    assert np.all(env >= raw - 1e-6)  # padding to a larger measured batch never makes things slower
    np.testing.assert_allclose(env[4], 6.0, rtol=1e-6)  # B=4 can run as the measured B=8


def test_max_tokens_truncates_and_rejects_extrapolation():
    t = table()
    assert t.to_dense(16).shape == (17,)
    with pytest.raises(ValueError, match="exceeds the largest measured batch"):
        t.to_dense(129)
    with pytest.raises(ValueError, match="interpolation"):
        t.to_dense(interpolation="cubic")


def test_dense_table_feeds_the_scheduler():
    dense = table().to_dense()
    conf = np.full((16, 7), 0.9, np.float32)
    s = scheduler.schedule_checked(conf, dense)
    assert 16 <= int(s.batch_tokens) < dense.shape[0]


def test_drafter_shape_warning():
    """A table profiled with one drafter and used with another says so, naming both shapes."""
    t = table(extra={"drafter": {"n_layers": 2, "ffn_dim": 1536, "rank": 256, "draft_vocab_size": 8192,
                                 "head": "markov"}})
    deeper = {"n_layers": 3, "ffn_dim": 1536, "rank": 256, "draft_vocab_size": 8192, "head": "markov", "dim": 576}
    with pytest.warns(UserWarning, match="drafter of n_layers=2 but is used with one of n_layers=3"):
        assert len(t.check_compatible(drafter=deeper)) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert t.check_compatible(drafter=dict(deeper, n_layers=2)) == []  # same shape; other fields ignored
        assert table().check_compatible(drafter=deeper) == []  # a table that records no drafter


def test_compatibility_warning():
    t = table(model="SmolLM2-135M", dtype="float32")
    with pytest.warns(UserWarning, match="model='SmolLM2-135M' but is used with model='other'"):
        msgs = t.check_compatible(model="other", dtype="float32")
    assert len(msgs) == 1
