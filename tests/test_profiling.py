"""SPS profiling: the cost model in tables (round trip, validation, fill rules, interpolation, envelope), the
jitted sps_from_cost against the NumPy sps_for, the profiler's cells and batches, a real quick profile of a
tiny model on the CPU, and the script's early errors."""

import dataclasses
import datetime
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import measure, scheduler
from dspark_jax.models.llama import bucket_for, check_packed, context_bucket, init_cache, LlamaConfig
from dspark_jax.plots import plot_sps
from dspark_jax.sps import (CostModel, SPSMetadata, SPSTable, context_window, default_sps_table, load_sps_table,
                            plain_sps_from_cost,
                            realistic_rows, round_windows, sps_from_cost)
from profiling import profile_sps
from tests.helpers import count_compilations

G = 7


# ----------------------------------------------------------------------------------------------------
# Synthetic cost models: affine in the windows, so linear interpolation between windows is exact.


def verify_true(R, T, W):
    return 1e-3 * (1.0 + 0.5 * T + 0.01 * R * W)


def draft_true(R, W):
    return 1e-3 * (2.0 + 0.02 * R * W)


def synthetic(rows=(1, 2, 4), batch=(8, 16, 32), contexts=(120, 504), cells=None, rule="pow2", block=G):
    wins = [round_windows(L, block, 128, rule) for L in contexts]
    measured = set(cells) if cells is not None else {(r, t) for r in rows for t in batch}
    verify = [[[verify_true(r, t, wv) if (r, t) in measured else None for t in batch] for r in rows]
              for wv, _ in wins]
    spread = [[[None if v is None else 0.1 * v for v in row] for row in ctx] for ctx in verify]
    draft = [[draft_true(r, wd) for r in rows] for _, wd in wins]
    return CostModel(block=block, context_step=128, window_rule=rule, context_lengths=contexts,
                     windows=[w for w, _ in wins], draft_windows=[w for _, w in wins], rows=rows, batch_tokens=batch,
                     verify_s=verify, verify_spread_s=spread, draft_s=draft,
                     draft_spread_s=[[0.0] * len(rows) for _ in contexts])


def table_with(cm, **meta):
    pts = measure.sps_points(cm, cm.context_lengths[0])
    return SPSTable(pts, SPSMetadata(**meta), cm)


# ----------------------------------------------------------------------------------------------------
# Windows


def test_context_window_rules():
    n = np.arange(0, 3000)
    pow2 = [context_window(int(x)) for x in n]
    want = [max(128, 1 << (max(int(x), 1) - 1).bit_length()) for x in n]
    assert pow2 == want
    assert [context_window(int(x), rule="step") for x in n] == [context_bucket(int(x), 10**9) for x in n]
    for rule in ("pow2", "step"):
        jitted = jax.jit(jax.vmap(lambda x: context_window(x, 128, rule)))(jnp.asarray(n, jnp.int32))
        np.testing.assert_array_equal(np.asarray(jitted), [context_window(int(x), rule=rule) for x in n])
    with pytest.raises(ValueError, match="rule"):
        context_window(5, rule="cubic")
    assert round_windows(1016, G) == (1024, 1024) and round_windows(1017, G) == (2048, 1024)


# ----------------------------------------------------------------------------------------------------
# Table round trip and validation


def test_round_trip_with_cost_model(tmp_path):
    cm = synthetic(cells=measure.verify_cells((1, 2, 4), (8, 16, 32), G))
    t = table_with(cm, device_kind="cpu", backend="cpu", model="m", dtype="float32", context_length=120,
                   date="2026-11-29", extra={"rows": [1, 2, 4]})
    path = tmp_path / "t.json"
    t.save(path)
    obj = json.loads(path.read_text())
    assert obj["cost_model"]["verify_s"][0][0][1] is None  # unmeasured cells are null
    back = SPSTable.load(path)
    assert back == t and back.cost_model == cm
    np.testing.assert_array_equal(back.sps_for(3, 300), t.sps_for(3, 300))


def test_tables_without_cost_model_stay_as_they_were(tmp_path):
    t = SPSTable.from_arrays((1, 8), (10.0, 5.0))
    assert t.cost_model is None and "cost_model" not in t.to_json()
    path = tmp_path / "old.json"
    t.save(path)
    assert SPSTable.load(path) == t
    with pytest.raises(ValueError, match="no cost model"):
        t.sps_for(1, 100)
    with pytest.raises(ValueError, match="no cost model"):
        t.cost_arrays()


def _mutate(obj, path, value):
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("rows",), [1, 4, 2], "rows must be strictly increasing"),
        (("batch_tokens",), [8, 16, 0], "batch_tokens must hold integers >= 1"),
        (("windows",), [128, 256], r"windows must be \[128, 512\]"),
        (("window_rule",), "cubic", "window_rule must be one of"),
        (("block",), 0, "block must be an integer >= 1"),
        (("verify_s", 1), [[1.0, 1.0, 1.0]], r"verify_s\[1\] must have 3 entries"),
        (("verify_s", 0, 1, 2), -1.0, r"verify_s\[0\]\[1\]\[2\] \(context 120, rows 2, B 32\) must be finite and > 0"),
        (("verify_s", 0, 2, 2), None, "must be measured: the largest row count at the largest batch"),
        (("verify_spread_s", 0, 0, 0), None, "spread of verify_s"),
        (("draft_s", 1, 0), float("nan"), r"draft_s\[1\]\[0\] \(context 504, rows 1\)"),
    ],
)
def test_cost_model_validation_errors(tmp_path, path, value, match):
    obj = table_with(synthetic()).to_json()
    _mutate(obj["cost_model"], path, value)
    if path[0] == "verify_s" and value is None:  # an unmeasured cell has no spread either
        _mutate(obj["cost_model"], ("verify_spread_s", *path[1:]), None)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=match):
        SPSTable.load(f)


def test_unmeasured_cell_with_spread_and_json_shape_errors(tmp_path):
    obj = table_with(synthetic()).to_json()
    obj["cost_model"]["verify_s"][0][0][0] = None
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="is not measured but has a spread"):
        SPSTable.load(f)
    obj = table_with(synthetic()).to_json()
    obj["cost_model"]["colour"] = 1
    f.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"unknown \['colour'\]"):
        SPSTable.load(f)
    obj = table_with(synthetic()).to_json()
    obj["points"] = obj["points"][:-1]  # points end at 16, the cost model at 32
    f.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="points end at B=16 but the cost model at B=32"):
        SPSTable.load(f)
    with pytest.raises(ValueError, match="context lengths 100 and 110 share the verification window 128"):
        measure.profile_cost_model(None, None, None, context_lengths=(100, 110), batch_tokens=(8,))


# ----------------------------------------------------------------------------------------------------
# Fill rules, interpolation, envelope


def test_fill_rules_are_conservative():
    cells = [(1, 8), (2, 16), (4, 8), (4, 32)]
    cm = synthetic(cells=cells)
    filled, _ = cm.filled_verify()
    c = 0
    wv = cm.windows[c]
    # (4, 16) pads up to the measured (4, 32); (2, 8) pads up to (2, 16); (2, 32) comes from (4, 32);
    # (1, 16) and (1, 32) come from the row above.
    np.testing.assert_allclose(filled[c, 2, 1], verify_true(4, 32, wv))
    np.testing.assert_allclose(filled[c, 1, 0], verify_true(2, 16, wv))
    np.testing.assert_allclose(filled[c, 1, 2], verify_true(4, 32, wv))
    np.testing.assert_allclose(filled[c, 0, 1], verify_true(2, 16, wv))
    np.testing.assert_allclose(filled[c, 0, 2], verify_true(4, 32, wv))
    # measured cells untouched, and no cell is ever cheaper than the truth for an affine cost
    truth = np.array([[verify_true(r, t, wv) for t in cm.batch_tokens] for r in cm.rows])
    assert np.all(filled[c] >= truth - 1e-12)
    for r, t in cells:
        np.testing.assert_allclose(filled[c, cm.rows.index(r), cm.batch_tokens.index(t)], verify_true(r, t, wv))


def reference_step_times(cm, R, L):
    """Plain Python: round seconds for every b, ceil interpolation, every cell measured, affine cost."""
    rb = min(r for r in cm.rows if r >= R)
    wv, wd = round_windows(L, cm.block, cm.context_step, cm.window_rule)
    wv, wd = max(wv, cm.windows[0]), max(wd, cm.draft_windows[0])  # clamped below the first window
    out = []
    for b in range(cm.max_tokens + 1):
        t = min(x for x in cm.batch_tokens if x >= max(b, 1))
        out.append(verify_true(rb, t, wv) + draft_true(rb, wd))
    return np.array(out)


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("L", [0, 100, 120, 121, 300, 504, 505, 1016, 5000])
def test_sps_for_matches_reference(R, L):
    cm = synthetic()
    t = table_with(cm)
    want = reference_step_times(cm, R, L)
    got = t.sps_for(R, L, interpolation="ceil")
    assert got.shape == (cm.max_tokens + 1,) and got.dtype == np.float32
    np.testing.assert_allclose(1 / got, want, rtol=1e-6)


def test_linear_interpolation_and_envelope_on_cost_model():
    cm = synthetic(batch=(8, 32))
    lin = cm.step_times(2, 120)
    ceil = cm.step_times(2, 120, interpolation="ceil")
    wv, wd = cm.windows_for(120)
    np.testing.assert_allclose(lin[20], 0.5 * (verify_true(2, 8, wv) + verify_true(2, 32, wv)) + draft_true(2, wd))
    np.testing.assert_allclose(ceil[20], verify_true(2, 32, wv) + draft_true(2, wd))
    # a jagged row (B=16 measured slower than B=32 and than 4 rows at B=16): the slow cell is lowered to the
    # fastest cell at or beyond it (4 rows; timing noise only adds time), so a larger batch is never priced
    # below a smaller one and the envelope has nothing left to do
    obj = synthetic().to_json()
    obj["verify_s"][0][1][1] = 1.0
    jag = CostModel(**obj)
    raw, env = jag.step_times(2, 120), jag.step_times(2, 120, envelope=True)
    wv, wd = jag.windows_for(120)
    assert np.all(np.diff(raw) >= 0) and raw[15] < raw[16]
    low, high = verify_true(4, 16, wv), verify_true(2, 32, wv)
    np.testing.assert_allclose(raw[[16, 24, 32]], np.array([low, 0.5 * (low + high), high]) + draft_true(2, wd))
    np.testing.assert_array_equal(env, raw)
    np.testing.assert_allclose(np.asarray(sps_from_cost(jag.arrays(), jnp.int32(2), jnp.int32(120))), 1 / raw,
                               rtol=2e-6)
    with pytest.raises(ValueError, match="interpolation"):
        cm.step_times(1, 0, interpolation="cubic")


@pytest.mark.parametrize("R,L,match", [(0, 10, "num_requests: expected 1..4"), (5, 10, "profile more rows"),
                                       (2, -1, "context_tokens"), (2.5, 10, "num_requests: expected an integer")])
def test_sps_for_rejects_bad_queries(R, L, match):
    with pytest.raises(ValueError, match=match):
        table_with(synthetic()).sps_for(R, L)


def test_jitted_sps_equals_numpy_and_does_not_recompile():
    cm = synthetic(cells=measure.verify_cells((1, 2, 4), (8, 16, 32), G))
    table = table_with(cm)
    for interpolation in ("linear", "ceil"):
        arrays = table.cost_arrays(interpolation=interpolation)
        for envelope in (False, True):
            for R, L in [(1, 0), (2, 130), (3, 504), (4, 700), (4, 3000)]:
                got = sps_from_cost(arrays, jnp.int32(R), jnp.int32(L), envelope=envelope)
                want = table.sps_for(R, L, interpolation=interpolation, envelope=envelope)
                np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6)

    conf = jnp.full((4, G), 0.8, jnp.float32)

    @jax.jit
    def round_lengths(cost, n, longest):
        sps = sps_from_cost(cost, n, longest)
        return scheduler.schedule(conf, sps, active=jnp.arange(4) < n).lengths

    arrays = table.cost_arrays()
    round_lengths(arrays, jnp.int32(1), jnp.int32(10)).block_until_ready()
    sps_from_cost(arrays, jnp.int32(1), jnp.int32(10)).block_until_ready()
    loads = [(jnp.int32(n), jnp.int32(L)) for n, L in [(2, 100), (3, 600), (4, 2000), (1, 5)]]
    with count_compilations() as n_compiled:
        for n, L in loads:
            round_lengths(arrays, n, L).block_until_ready()
            sps_from_cost(arrays, n, L).block_until_ready()
    assert n_compiled() == 0


def test_more_context_and_more_requests_cost_more():
    cm = synthetic()
    t = table_with(cm)
    base = t.sps_for(2, 120)
    assert np.all(t.sps_for(2, 1016) < base)  # longer contexts: fewer rounds per second, at every B
    assert np.all(t.sps_for(2, 5000) < t.sps_for(2, 1016))  # extrapolated beyond the last window, upwards
    assert np.all(t.sps_for(4, 120) < base)  # more rows at the same B


# ----------------------------------------------------------------------------------------------------
# What the profiler measures


@pytest.mark.parametrize("rows,batch", [((1, 2, 4, 8, 16, 32, 64), (8, 16, 32, 64, 128, 256, 512)),
                                        ((1, 2, 4, 8), (8, 16, 32, 64)), ((2, 8), (8, 32, 64))])
def test_verify_cells_cover_every_reachable_round(rows, batch):
    cells = set(measure.verify_cells(rows, batch, G))
    for active in range(1, rows[-1] + 1):
        rb = min(r for r in rows if r >= active)
        for b in range(active, min(active * (G + 1), batch[-1]) + 1):
            t = min(x for x in batch if x >= b)
            assert (rb, t) in cells, (active, b)
    assert (rows[-1], batch[-1]) in cells
    # and nothing a round cannot reach, except the largest row's larger buckets
    for r, t in cells:
        i = rows.index(r)
        lo = (rows[i - 1] if i else 0) + 1
        assert t >= min(x for x in batch if x >= lo)
        if r != rows[-1]:
            assert t <= min((x for x in batch if x >= r * (G + 1)), default=batch[-1])


def test_diagonal_cells_and_rows():
    assert measure.diagonal_cells((8, 32, 128, 256), max_rows=64, block=G) == [(2, 8), (8, 32), (32, 128), (64, 256)]
    assert [realistic_rows(b) for b in (8, 16, 32, 64, 128, 256, 512)] == [2, 4, 8, 16, 32, 64, 64]
    assert measure.row_buckets(512, G) == (1, 2, 4, 8, 16, 32, 64)
    assert measure.token_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    with pytest.raises(ValueError, match="max_tokens"):
        measure.token_buckets(4096)


@pytest.mark.parametrize("rows,T,L", [(1, 8, 0), (2, 8, 120), (4, 16, 30), (3, 64, 5), (64, 512, 100)])
def test_verify_batch_keeps_the_packed_contract(rows, T, L):
    cfg = LlamaConfig.tiny()
    W, _ = round_windows(L, G)
    cache = init_cache(cfg, rows, W).replace(lengths=jnp.full((rows,), L, jnp.int32))
    tokens, slots, positions, valid = measure.verify_batch(rows=rows, batch_tokens=T, context=L, block=G,
                                                             vocab_size=cfg.vocab_size)
    check_packed(cache, tokens, slots, positions, valid, max_per_slot=G + 1)
    assert valid.sum() == min(T, rows * (G + 1)) and T == bucket_for(T)
    assert positions[valid].max() < W


def test_timed_calls_do_not_compile(monkeypatch):
    """After one warm-up call, the timed calls of both measurements compile nothing (the donated cache comes
    back committed to the device: the inputs are committed too)."""
    counts = []

    def probe(fn, **kw):
        jax.block_until_ready(fn())
        with count_compilations() as n:
            for _ in range(3):
                jax.block_until_ready(fn())
        counts.append(n())
        return measure.Timing(1.0, 1.0, 1.0, 1)

    monkeypatch.setattr(measure, "time_call", probe)
    cfg = LlamaConfig.tiny()
    from dspark_jax.models.llama import init_random_weights

    w = jax.device_put(init_random_weights(cfg, jax.random.key(1)), jax.devices()[0])
    measure.time_verify(w, cfg, rows=1, batch_tokens=8, context=3)
    measure.time_draft(measure.random_drafter(cfg), w.embed, rows=1, context=3)
    assert counts == [0, 0]


def test_profile_times_the_programs_of_each_group_in_turns(monkeypatch):
    """Every (context, rows) group's programs (drafter, plain round, each verification cell of those rows) are
    timed together in turns, so the ratios between them hold on a drifting host; every cell gets its time."""
    groups = []
    real = measure.interleaved

    def spy(thunks, **kw):
        groups.append(sorted(thunks))
        return real(thunks, **kw)

    monkeypatch.setattr(measure, "interleaved", spy)
    cfg = LlamaConfig.tiny()
    from dspark_jax.models.llama import init_random_weights

    w = jax.device_put(init_random_weights(cfg, jax.random.key(1)), jax.devices()[0])
    cm = measure.profile_cost_model(w, cfg, measure.random_drafter(cfg), context_lengths=(120,), batch_tokens=(8, 16),
                                    rows=(1, 2), repeats=2, min_seconds=0.0)
    assert groups == [[("draft", 0), ("plain", 1), ("verify", 8)],
                      [("draft", 0), ("plain", 2), ("verify", 8), ("verify", 16)]]
    assert cm.verify_s[0][0][0] > 0 and cm.verify_s[0][0][1] is None and min(cm.verify_s[0][1]) > 0
    assert min(cm.plain_s[0]) > 0 and min(cm.draft_s[0]) > 0


def test_programs_read_from_the_persistent_cache_count():
    """The suite runs with a persistent compilation cache (conftest). A program read back from it after the
    in-memory caches were dropped was not compiled, but the block needed it: `compile_count` (JAX's backend
    compilation event, which JAX also reports for a cache read) counts it, so the "nothing new after warm-up"
    tests cannot miss a program that an earlier test left on disk."""
    assert jax.config.jax_compilation_cache_dir
    hits = []
    listener = lambda event, **kw: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None
    jax.monitoring.register_event_listener(listener)
    try:
        f = jax.jit(lambda x: jnp.cumsum(x * 3.25 + 0.5)[::-2])
        x = jnp.arange(13.0)
        with count_compilations() as n:
            first = f(x).block_until_ready()
        assert n() == 1
        jax.clear_caches()
        hits.clear()
        with count_compilations() as n:
            np.testing.assert_array_equal(f(x), first)
        assert hits == [1] and n() == 1  # read from disk, counted once
        with count_compilations() as n:
            f(x).block_until_ready()
        assert n() == 0
    finally:
        jax.monitoring.unregister_event_listener(listener)

# ----------------------------------------------------------------------------------------------------
# A real quick profile of the tiny model, through the script


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("sps") / "tiny.json"
    table = profile_sps.main(["--tiny", "--quick", "--max-tokens", "16", "--context-lengths", "120", "248",
                              "--repeats", "2", "--out", str(out)])
    return table, out


def test_quick_tiny_profile_gives_a_valid_table(tiny_profile):
    table, out = tiny_profile
    loaded = SPSTable.load(out)
    assert loaded == table
    meta = loaded.metadata
    assert (meta.backend, meta.device_kind, meta.model, meta.dtype) == (
        jax.default_backend(), jax.devices()[0].device_kind, "tiny-random", "float32")
    assert meta.context_length == 120 and meta.date == datetime.date.today().isoformat()
    assert meta.extra["jax_version"] == jax.__version__ and meta.extra["context_lengths"] == [120, 248]
    cm = loaded.cost_model
    assert cm.block == G and cm.context_lengths == (120, 248) and cm.windows == (128, 256)
    assert list(loaded.batch_tokens) == [8, 16] and cm.batch_tokens == (8, 16)
    assert all(d > 0 for row in cm.draft_s for d in row)
    assert cm.plain_s is not None and all(p > 0 for row in cm.plain_s for p in row)
    # --quick measures the engine-round overhead at one row; the other rows take its value
    assert cm.overhead_s is not None and len(cm.overhead_s) == 2
    for kind in cm.overhead_s:
        assert len(kind) == len(cm.rows) and all(v == kind[0] for v in kind)
    assert meta.extra["round_overhead_temperature"] == 0.0
    for R in range(1, cm.rows[-1] + 1):
        got = float(plain_sps_from_cost(loaded.cost_arrays(), jnp.int32(R), jnp.int32(200)))
        assert got == pytest.approx(1 / cm.plain_step_time(R, 200), rel=1e-5)
    conf = np.full((cm.rows[-1], G), 0.9, np.float32)
    s = scheduler.schedule_checked(conf, loaded.to_dense())
    assert cm.rows[-1] <= int(s.batch_tokens) <= loaded.max_tokens
    for R in range(1, cm.rows[-1] + 1):
        for L in (0, 120, 200, 248, 4000):
            sps = loaded.sps_for(R, L)
            scheduler.schedule_checked(conf[:R], sps)
            np.testing.assert_allclose(np.asarray(sps_from_cost(loaded.cost_arrays(), jnp.int32(R), jnp.int32(L))),
                                       sps, rtol=2e-6)
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every time was put at the host's median speed over the profile, recorded with the probes' range
    assert meta.extra["host_reference"] == measure.reference_label(120, cm.window_rule)
    lo, hi = meta.extra["host_drift"]
    assert meta.extra["host_reference_s"] > 0 and 0 < lo <= 1 <= hi


def test_metadata_mismatch_warns(tiny_profile, tmp_path):
    _, out = tiny_profile
    with pytest.warns(UserWarning, match="model='tiny-random' but is used with model='SmolLM2"):
        load_sps_table(out, model="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
    with pytest.warns(UserWarning, match="block=7 but is used with block=4"):
        load_sps_table(out, block=4)
    with pytest.warns(UserWarning, match="dtype='float32' but is used with dtype='bfloat16'"):
        load_sps_table(out, dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_sps_table(out, model="tiny-random", dtype="float32", backend=jax.default_backend(), block=G)


def test_engine_warns_when_its_drafter_is_not_the_profiled_one(tiny_profile):
    """The table records the drafter it timed; an engine drafting with another shape says so."""
    from flax import nnx

    from dspark_jax.build import LoadedDrafter, build_engine
    from dspark_jax.models.drafter import Drafter
    from dspark_jax.models.llama import LlamaModel, init_random_weights

    table, _ = tiny_profile
    cfg = LlamaConfig.tiny()
    target = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0)))
    same = measure.random_drafter(cfg, block=G)
    deeper_cfg = dataclasses.replace(same.cfg, n_layers=same.cfg.n_layers + 1)
    deeper = Drafter(deeper_cfg, rngs=nnx.Rngs(0), vocab_ids=np.arange(deeper_cfg.draft_vocab, dtype=np.int32))

    def engine(drafter):
        return build_engine(target, "dspark", draft=LoadedDrafter(drafter, None, 0.5, None), sps=table, num_slots=2,
                            capacity=64)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine(same)
    with pytest.warns(UserWarning, match=f"n_layers={same.cfg.n_layers} but is used with one of "
                                         f"n_layers={same.cfg.n_layers + 1}.*profile_sps"):
        engine(deeper)


# ----------------------------------------------------------------------------------------------------
# The script's early errors (before anything is loaded or measured)


@pytest.fixture
def no_measuring(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("measured before checking the output")

    monkeypatch.setattr(profile_sps, "load_target", boom)
    monkeypatch.setattr(measure, "profile_sps_table", boom)


def test_unwritable_output_fails_early(tmp_path, no_measuring):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="does not exist"):
        profile_sps.main(["--tiny", "--out", str(blocker / "t.json")])
    with pytest.raises(ValueError, match="is a folder"):
        profile_sps.main(["--tiny", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="does not exist"):
        profile_sps.main(["--tiny", "--out", str(tmp_path / "t.json"), "--png", str(blocker / "t.png")])


def test_missing_backend_is_named(tmp_path, no_measuring):
    missing = next(b for b in ("tpu", "gpu", "cpu") if b not in measure.available_backends())
    with pytest.raises(ValueError, match=rf"backend '{missing}' is not available.*available backends: \['cpu'"):
        profile_sps.main(["--tiny", "--backend", missing, "--out", str(tmp_path / "t.json")])
    assert measure.select_device("cpu").platform == "cpu"
    assert measure.select_device() == jax.devices()[0]


def test_reference_context_must_be_measured(tmp_path, no_measuring):
    with pytest.raises(ValueError, match="--reference-context 7 must be one of"):
        profile_sps.main(["--tiny", "--context-lengths", "120", "--reference-context", "7",
                          "--out", str(tmp_path / "t.json")])


# ----------------------------------------------------------------------------------------------------
# The packaged default table


def test_missing_default_table_is_clear(monkeypatch):
    from dspark_jax.sps import tables

    monkeypatch.setattr(tables, "DEFAULT_TABLE", "assets/sps/no_such_table.json")
    with pytest.raises(ValueError, match="packaged SPS table assets/sps/no_such_table.json is missing"):
        default_sps_table()


def _cpu(vendor="GenuineIntel", model_name="Intel(R) Xeon(R) Processor", isa="amx", cores=2, machine="x86_64",
         family=""):
    return {"vendor": vendor, "model_name": model_name, "family": family, "isa": isa, "cores": cores,
            "machine": machine}


def test_packaged_table_is_chosen_by_the_host_it_was_measured_on():
    """The packaged table measured on the CPU most like this one: the same vector unit at least, then the same
    family and model numbers, then the model name; ties keep the default; an unlike CPU or an accelerator gets
    the default and a warning that names the host and how to profile one."""
    from dspark_jax.sps import DEFAULT_TABLE, select_packaged_table

    amd = _cpu(vendor="AuthenticAMD", model_name="", isa="avx2")
    xeon = _cpu()
    tables = [(DEFAULT_TABLE, {"backend": "cpu", "extra": {"cpu": amd}}),
              ("assets/sps/xeon.json", {"backend": "cpu", "extra": {"cpu": xeon}}),
              ("assets/sps/old.json", {"backend": "cpu", "extra": {}}),
              ("assets/sps/h100.json", {"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})]
    pick = lambda cpu, **kw: select_packaged_table(kw.pop("backend", "cpu"), kw.pop("device_kind", "cpu"),
                                                   cpu=cpu, tables=tables)
    assert pick(xeon) == ("assets/sps/xeon.json", None)
    assert pick(_cpu(model_name="another Xeon")) == ("assets/sps/xeon.json", None)  # same vector unit
    assert pick(_cpu(vendor="AuthenticAMD", model_name="AMD EPYC 7B13", isa="avx2", cores=4)) == (DEFAULT_TABLE, None)
    # an AVX-512 CPU without AMX: like neither table; the closest (the Intel one: vendor and cores) with a warning
    name, warning = pick(_cpu(model_name="Intel(R) Xeon(R) Gold 6338", isa="avx512"))
    assert name == "assets/sps/xeon.json" and "Gold 6338" in warning and "avx512" in warning
    assert "profiling.profile_sps" in warning
    name, warning = pick(_cpu(vendor="", model_name="", isa="neon", cores=8, machine="aarch64"))
    assert name == DEFAULT_TABLE and "no packaged SPS table was measured on a CPU like this one" in warning
    # a generic model name under a hypervisor ("AMD EPYC" for two generations) never outweighs the vector unit
    zen4 = _cpu(vendor="AuthenticAMD", model_name="AMD EPYC", isa="avx512", family="25/17")
    tables.insert(2, ("assets/sps/zen4.json", {"backend": "cpu", "extra": {"cpu": zen4}}))
    assert pick(zen4) == ("assets/sps/zen4.json", None)
    assert pick(_cpu(vendor="AuthenticAMD", model_name="AMD EPYC", isa="avx2", family="23/49")) == (DEFAULT_TABLE, None)
    assert pick(_cpu(vendor="AuthenticAMD", model_name="AMD EPYC 9B14", isa="avx512", family="25/17")) \
        == ("assets/sps/zen4.json", None)
    # the same vector unit on another vendor is still a match (the only AVX-512 table), without a warning
    assert pick(_cpu(model_name="Intel(R) Xeon(R) Gold 6338", isa="avx512")) == ("assets/sps/zen4.json", None)
    assert pick(None, backend="gpu", device_kind="NVIDIA H100 80GB HBM3") == ("assets/sps/h100.json", None)
    name, warning = pick(None, backend="tpu", device_kind="TPU v5 lite")
    assert name == DEFAULT_TABLE and "no packaged SPS table was measured on tpu (TPU v5 lite)" in warning


def test_host_cpu_reads_the_vector_unit(monkeypatch, tmp_path):
    """``host_cpu`` on this machine has every field, and from a cpuinfo text it takes the first processor's
    vendor and model name and the widest vector unit among its flags."""
    from dspark_jax import sps

    here = sps.host_cpu()
    assert set(here) == {"vendor", "model_name", "family", "isa", "cores", "machine"} and here["cores"] >= 1
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
                    "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n\n"
                    "processor\t: 1\nvendor_id\t: Other\nmodel\t\t: 2\n")
    from dspark_jax.sps import host

    real = host.Path
    monkeypatch.setattr(host, "Path", lambda p: real(info) if str(p) == "/proc/cpuinfo" else real(p))
    cpu = sps.host_cpu()
    assert (cpu["vendor"], cpu["model_name"], cpu["family"], cpu["isa"]) == ("AuthenticAMD", "AMD EPYC 7B13",
                                                                            "25/1", "avx2")


def test_every_packaged_table_loads_and_names_its_cpu():
    """Each packaged table is a valid table of the shipped model with a cost model, and each CPU table records
    the host it was measured on with the fields :func:`host_cpu` gives (what the selection matches)."""
    import importlib.resources

    from dspark_jax import sps

    tables = sps.packaged_tables()
    assert tables[0][0] == sps.DEFAULT_TABLE and len(tables) >= 3
    for name, _ in tables:
        with importlib.resources.as_file(importlib.resources.files("dspark_jax").joinpath(name)) as path:
            t = load_sps_table(path, model="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32", block=G)
        assert t.cost_model is not None and t.max_tokens >= 256, name
        if t.metadata.backend == "cpu":
            cpu = t.metadata.extra["cpu"]
            assert set(sps.host_cpu()) - {"family"} <= set(cpu) and cpu["isa"] and cpu["cores"] >= 1, name
            # the table is the one chosen on the host it records
            assert sps.select_packaged_table("cpu", "cpu", cpu=cpu, tables=tables) == (name, None)


def _packaged_default_table() -> bool:
    import importlib.resources

    from dspark_jax.sps import DEFAULT_TABLE

    return importlib.resources.files("dspark_jax").joinpath(DEFAULT_TABLE).is_file()


@pytest.mark.skipif(not _packaged_default_table(),
                    reason="TODO(sps-default-table): measure dspark_jax/assets/sps/cpu_smollm2_135m.json on a quiet "
                           "CPU (README, 'SPS profiling (measured)')")
def test_default_table_is_packaged_and_usable():
    t = default_sps_table(model="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32", block=G)
    cm = t.cost_model
    assert cm is not None and t.max_tokens >= 256 and t.metadata.backend == "cpu"
    assert t.metadata.model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(cm.context_lengths) >= 2
    conf = np.full((16, G), 0.8, np.float32)
    scheduler.schedule_checked(conf, t.to_dense())
    scheduler.schedule_checked(conf, t.sps_for(16, 700))


def test_plot_without_cost_model(tmp_path):
    t = SPSTable.from_arrays((1, 8, 32), (10.0, 8.0, 3.0), metadata=SPSMetadata(context_length=64))
    png = plot_sps(t, tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plain_rounds_optional_with_fallback_and_round_trip(tmp_path):
    """Tables profiled before plain rounds were measured load and charge a plain round as the verification
    cell at B = rows; measured plain rounds take over, survive JSON, and are validated."""
    cm = synthetic()
    grid = cm.verify_grid("linear")
    for c in range(len(cm.context_lengths)):
        for r, rows in enumerate(cm.rows):
            assert cm.plain_grid()[c, r] == pytest.approx(grid[c, r, rows])
    plain = [[0.5e-3 * (1 + r) for r in range(len(cm.rows))] for _ in cm.context_lengths]
    spread = [[0.0] * len(cm.rows) for _ in cm.context_lengths]
    measured = dataclasses.replace(cm, plain_s=plain, plain_spread_s=spread)
    assert measured.plain_step_time(2, 120) == pytest.approx(plain[0][1])
    t = table_with(measured)
    t.save(tmp_path / "t.json")
    assert SPSTable.load(tmp_path / "t.json") == t
    old = table_with(cm)
    old.save(tmp_path / "old.json")
    assert "plain_s" not in json.loads((tmp_path / "old.json").read_text())["cost_model"]
    assert SPSTable.load(tmp_path / "old.json") == old
    with pytest.raises(ValueError, match="plain_s"):
        dataclasses.replace(cm, plain_s=plain, plain_spread_s=None)
    with pytest.raises(ValueError, match="plain_s"):
        dataclasses.replace(cm, plain_s=[[0.0] * len(cm.rows) for _ in cm.context_lengths], plain_spread_s=spread)


def test_round_overhead_adds_to_its_kind_everywhere(tmp_path):
    """The engine-round overhead is optional (tables without it load and charge nothing more), survives
    JSON, is validated, and adds its kind's seconds to every round time: the NumPy twins, the jitted
    curves the engine reads, and the simple points."""
    plain = [[0.5e-3 * (1 + r) for r in range(3)] for _ in range(2)]
    cm = dataclasses.replace(synthetic(), plain_s=plain, plain_spread_s=[[0.0] * 3 for _ in range(2)])
    over = [[1e-3, 2e-3, 4e-3], [3e-3, 5e-3, 7e-3]]
    with_over = dataclasses.replace(cm, overhead_s=over, overhead_spread_s=[[0.0] * 3, [1e-4] * 3])
    assert "overhead_s" not in table_with(cm).to_json()["cost_model"]
    np.testing.assert_array_equal(cm.overhead_grid(), np.zeros((2, 3)))
    for R, r in ((1, 0), (2, 1), (3, 2), (4, 2)):
        for L in (120, 300):
            np.testing.assert_allclose(with_over.step_times(R, L), cm.step_times(R, L) + over[0][r], rtol=1e-12)
            assert with_over.plain_step_time(R, L) == pytest.approx(cm.plain_step_time(R, L) + over[1][r])
            arrays = with_over.arrays()
            np.testing.assert_allclose(np.asarray(sps_from_cost(arrays, jnp.int32(R), jnp.int32(L))),
                                       1 / with_over.step_times(R, L), rtol=2e-6)
            assert float(plain_sps_from_cost(arrays, jnp.int32(R), jnp.int32(L))) == pytest.approx(
                1 / with_over.plain_step_time(R, L), rel=2e-6)
    curve, base = with_over.curve(120), cm.curve(120)
    r = np.searchsorted(np.asarray(cm.rows), curve["rows"])
    np.testing.assert_allclose(curve["step_s"], base["step_s"] + np.asarray(over[0])[r])
    t = table_with(with_over)
    t.save(tmp_path / "t.json")
    assert SPSTable.load(tmp_path / "t.json") == t
    with pytest.raises(ValueError, match="overhead_s and overhead_spread_s must be given together"):
        dataclasses.replace(cm, overhead_s=over)
    with pytest.raises(ValueError, match=r"overhead_s\[1\]\[2\] \(plain round, rows 4\) = -1.0 makes a round free"):
        dataclasses.replace(cm, overhead_s=[over[0], [0.0, 0.0, -1.0]], overhead_spread_s=[[0.0] * 3] * 2)
    with pytest.raises(ValueError, match=r"overhead_s\[0\]\[0\] \(drafting round, rows 1\) must be finite"):
        dataclasses.replace(cm, overhead_s=[[float("nan")] * 3, over[1]], overhead_spread_s=[[0.0] * 3] * 2)
    slower = dataclasses.replace(cm, overhead_s=[[-1e-4] * 3, [-1e-4] * 3], overhead_spread_s=[[0.0] * 3] * 2)
    assert slower.plain_step_time(1, 120) == pytest.approx(cm.plain_step_time(1, 120) - 1e-4)  # a correction
    with pytest.raises(ValueError, match=r"overhead_s must have 2 entries"):
        dataclasses.replace(cm, overhead_s=[over[0]], overhead_spread_s=[[0.0] * 3])


def test_nondecreasing_fit_pools_adjacent_violators():
    from dspark_jax.sps import nondecreasing

    np.testing.assert_allclose(nondecreasing([3.0, 1.0, 2.0]), [2.0, 2.0, 2.0])
    np.testing.assert_allclose(nondecreasing([1.0, 3.0, 2.0, 4.0]), [1.0, 2.5, 2.5, 4.0])
    np.testing.assert_allclose(nondecreasing([1.0, 2.0, 5.0]), [1.0, 2.0, 5.0])
    rng = np.random.default_rng(0)
    for _ in range(50):
        y = rng.normal(size=7)
        fit = nondecreasing(y)
        assert np.all(np.diff(fit) >= -1e-12) and fit.sum() == pytest.approx(y.sum())
        # no other non-decreasing sequence on a grid of candidates is closer
        for _ in range(20):
            other = np.sort(rng.normal(size=7))
            assert np.sum((fit - y) ** 2) <= np.sum((other - y) ** 2) + 1e-12


def test_monotone_minorant_is_the_greatest_monotone_array_below():
    """The cost model's reading of noisy cells: f[i] = min of y over every cell at or beyond i in each axis
    (brute force), non-decreasing along each axis, never above y; the faster of two cells out of order is
    kept as measured."""
    import itertools

    from dspark_jax.sps import monotone_minorant

    np.testing.assert_allclose(monotone_minorant([32.7, 56.5, 34.4, 42.4], (0,)), [32.7, 34.4, 34.4, 42.4])
    rng = np.random.default_rng(1)
    for shape in ((4, 7), (3, 4, 5)):
        y = rng.lognormal(size=shape)
        f = monotone_minorant(y, range(len(shape)))
        for idx in itertools.product(*map(range, shape)):
            beyond = y[tuple(slice(i, None) for i in idx)]
            assert f[idx] == beyond.min()
        for axis in range(len(shape)):
            assert np.all(np.diff(f, axis=axis) >= 0)


def test_slow_cell_does_not_raise_the_price_of_shorter_contexts(tmp_path):
    """One cell measured slow (a burst of host load: a plain round at 248 tokens slower than at 504, as in a
    table profiled on a shared host) is lowered to the longer context's time, so the drafter gate does not
    see plain decoding slow down and then speed up as the context grows; drafts and verification likewise."""
    cm = default_sps_table().cost_model
    plain = np.array(cm.plain_s, dtype=np.float64)
    plain[1, 0] = 3 * plain[2, 0]  # context 248 (row 1 of the contexts), one request
    draft = np.array(cm.draft_s, dtype=np.float64)
    draft[0, 0] = 3 * draft[1, 0]
    noisy = dataclasses.replace(cm, plain_s=plain.tolist(), draft_s=draft.tolist())
    # the fastest cell at or beyond it in context and rows (the quadrant; the slow cell itself is 3 x another)
    assert noisy.plain_grid()[1, 0] == pytest.approx(plain[1:, :].min()) and plain[1:, :].min() < plain[1, 0]
    assert noisy.draft_grid()[0, 0] == pytest.approx(draft.min()) and draft.min() < draft[0, 0]
    times = [noisy.plain_step_time(1, L) for L in (100, 200, 400, 900)]
    assert times == sorted(times)
    for L in (100, 200, 400, 900):
        np.testing.assert_allclose(1 / np.asarray(sps_from_cost(noisy.arrays(), jnp.int32(1), jnp.int32(L))),
                                   noisy.step_times(1, L), rtol=1e-5)
    assert np.all(np.diff(noisy.verify_grid(), axis=0) >= -1e-12)  # windows: longer contexts never cheaper
    assert np.all(np.diff(noisy.verify_grid(), axis=1) >= -1e-12)  # rows


def test_drafting_overhead_by_padded_batch(tmp_path):
    """A drafting round's overhead may depend on the padded batch it verifies: measured cells replace the
    row's single value, missing cells take the next measured batch of the row (else its largest), a row
    without any keeps ``overhead_s[0]``; it is interpolated over the batch like verification, reaches the
    jitted curves, survives JSON and is validated."""
    cm = synthetic()  # rows (1, 2, 4), batches (8, 16, 32)
    over = [[1e-3, 2e-3, 4e-3], [3e-3, 5e-3, 7e-3]]
    spread = [[0.0] * 3, [0.0] * 3]
    by_batch = [[-2e-3, None, 6e-3], [None, None, None], [None, 8e-3, None]]
    by_spread = [[0.0, None, 1e-4], [None, None, None], [None, 0.0, None]]
    base = dataclasses.replace(cm, overhead_s=over, overhead_spread_s=spread)
    full = dataclasses.replace(base, draft_overhead_s=by_batch, draft_overhead_spread_s=by_spread)
    np.testing.assert_allclose(full.draft_overhead_table(), [[-2e-3, 6e-3, 6e-3], [2e-3] * 3, [8e-3] * 3])
    np.testing.assert_allclose(full.draft_overhead_table(spread=True), [[0.0, 1e-4, 1e-4], [0.0] * 3, [0.0] * 3])
    np.testing.assert_allclose(base.draft_overhead_table(), [[1e-3] * 3, [2e-3] * 3, [4e-3] * 3])
    for R, r in ((1, 0), (2, 1), (4, 2)):
        for L in (120, 300):
            extra = full.step_times(R, L) - base.step_times(R, L)
            # row 1 between its measured batches 8 and 16 (linear), then flat
            b = np.arange(len(extra))
            want = np.interp(b, [8, 16, 32], full.draft_overhead_table()[r]) - over[0][r]
            np.testing.assert_allclose(extra, want, atol=1e-12)
            assert full.plain_step_time(R, L) == base.plain_step_time(R, L)
            np.testing.assert_allclose(np.asarray(sps_from_cost(full.arrays(), jnp.int32(R), jnp.int32(L))),
                                       1 / full.step_times(R, L), rtol=2e-6)
    ceil = full.step_times(1, 120, interpolation="ceil") - base.step_times(1, 120, interpolation="ceil")
    assert ceil[9] == pytest.approx(6e-3 - 1e-3)  # a batch of 9 pays the 16 bucket's overhead
    t = table_with(full)
    t.save(tmp_path / "t.json")
    assert SPSTable.load(tmp_path / "t.json") == t
    with pytest.raises(ValueError, match="draft_overhead_s refines overhead_s, which is missing"):
        dataclasses.replace(cm, draft_overhead_s=by_batch, draft_overhead_spread_s=by_spread)
    with pytest.raises(ValueError, match="draft_overhead_s and draft_overhead_spread_s must be given together"):
        dataclasses.replace(base, draft_overhead_s=by_batch)
    with pytest.raises(ValueError, match=r"draft_overhead_s\[0\]\[1\] \(rows 1, B 16\) and its spread must be "
                                         r"measured together"):
        dataclasses.replace(full, draft_overhead_s=[[-2e-3, 1e-3, 6e-3], *by_batch[1:]])
    with pytest.raises(ValueError, match=r"draft_overhead_s\[2\]\[1\] \(rows 4, B 16\) = -1.0 makes a round free"):
        dataclasses.replace(full, draft_overhead_s=[*by_batch[:2], [None, -1.0, None]])
    with pytest.raises(ValueError, match=r"draft_overhead_s must have 3 entries"):
        dataclasses.replace(full, draft_overhead_s=by_batch[:2], draft_overhead_spread_s=by_spread[:2])


def test_add_overhead_extends_a_table_in_place(tiny_profile, tmp_path):
    """`--add-overhead` measures the engine-round overhead of an existing table at every row count and writes
    the table back with it, the rest unchanged."""
    table, out = tiny_profile
    copy = tmp_path / "t.json"
    copy.write_text(out.read_text())
    back = profile_sps.main(["--tiny", "--add-overhead", "--out", str(copy)])
    loaded = SPSTable.load(copy)
    assert loaded == back and loaded.metadata.extra["round_overhead_date"] == datetime.date.today().isoformat()
    cm = loaded.cost_model
    assert len(cm.overhead_s) == 2 and all(len(k) == len(cm.rows) for k in cm.overhead_s)
    # drafting rounds by padded batch: measured exactly at the batches each row count can verify
    for r, R in enumerate(cm.rows):
        have = {b for t, b in enumerate(cm.batch_tokens) if cm.draft_overhead_s[r][t] is not None}
        assert have == set(measure.overhead_batches(cm, R)) and have
    assert cm.without_overhead() == table.cost_model.without_overhead()
    # a table measured on other hardware is not extended here: two machines' times would share one table
    other = tmp_path / "tpu.json"
    other.write_text(json.dumps({**json.loads(out.read_text()), "metadata": {
        **json.loads(out.read_text())["metadata"], "backend": "tpu", "device_kind": "TPU v5 lite"}}))
    for flag in ("--add-overhead", "--add-plain"):
        with pytest.raises(ValueError, match=r"measured elsewhere \(backend 'tpu' there, 'cpu' here; device kind"):
            profile_sps.main(["--tiny", flag, "--out", str(other)])


# ----------------------------------------------------------------------------------------------------
# The host's speed: measurements put at one speed


@pytest.mark.parametrize("span, window, want", [
    ((0, 1), 5, 0.5),      # the first five probes: median 2
    ((3, 4), 3, 1 / 3),    # probes 3..5 (3, 3, 4): median 3
    ((8, 9), 5, 1 / 4),    # clipped at the end: probes 5..9 (3, 4, 4, 4, 4)
    ((0, 9), 3, 1 / 3),    # a span wider than the window: all its probes
    ((4, 4), 1, 1 / 3),
])
def test_host_factor_reads_the_probes_nearest_the_span(span, window, want):
    probes = [2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 4.0, 4.0, 4.0, 4.0]
    assert measure.host_factor(probes, span, 1.0, window) == pytest.approx(want)


def test_host_factor_rejects_spans_outside_the_probes():
    with pytest.raises(ValueError, match=r"probe span \(2, 3\) outside 0..2"):
        measure.host_factor([1.0, 1.0, 1.0], (2, 3), 1.0)


class _ScriptedSpeed(measure.HostSpeed):
    """A HostSpeed whose probes read a scripted host slowdown instead of timing a program."""

    def __init__(self, slowdown, reference=None, window=1):
        self.slowdown, self.window, self.probes, self._reference = slowdown, window, [], reference

    def probe(self):
        self.probes.append(0.01 * self.slowdown(len(self.probes)))
        return len(self.probes) - 1


def test_timed_jobs_put_a_drifting_host_at_one_speed():
    """A host that runs 2 x slower from the seventh of nine jobs on: rescaled, every job but the one between a
    fast and a slow probe costs what its work costs at the reference speed (the probes' median, or a
    recorded one); the job at the change is priced by both probes around it."""
    speed_at = lambda k: 1.0 if k < 6 else 2.0  # noqa: E731  (probe k runs just before job k)
    work = [0.1 * (j + 1) for j in range(9)]

    def run(j):
        t = work[j] * speed_at(j)
        return measure.Timing(t, 0.9 * t, 1.1 * t, 3)

    jobs = list(range(9))
    got = [tm.median for tm in measure.timed_jobs(jobs, run, _ScriptedSpeed(speed_at, window=2))]
    # probes 0..5 fast, 6..9 slow: median (reference) fast; job 5 ran fast between probes 5 (fast) and 6 (slow)
    assert got[:5] + got[6:] == pytest.approx(work[:5] + work[6:])
    assert got[5] == pytest.approx(work[5] / 1.5)
    spreads = [tm.spread for tm in measure.timed_jobs(jobs, run, _ScriptedSpeed(speed_at, window=2))]
    assert spreads == pytest.approx([0.1 * g for g in got])
    # a recorded reference at the slow speed (the table's): the rescaled times are at that speed
    got = [tm.median for tm in measure.timed_jobs(jobs, run, _ScriptedSpeed(speed_at, reference=0.02))]
    assert got[:5] + got[6:] == pytest.approx([2 * w for w in work[:5] + work[6:]])
    # without a speed, as measured
    got = measure.timed_jobs(jobs, run, None)
    assert [tm.median for tm in got] == pytest.approx([run(j).median for j in jobs])


def test_table_host_speed_takes_the_recorded_reference(tiny_profile):
    """`--add-overhead` / `--add-plain` measure at the speed the table recorded, for the same reference program
    only (another one's seconds mean nothing)."""
    from dspark_jax.models.llama import init_random_weights

    table, _ = tiny_profile
    cfg = LlamaConfig.tiny()
    w = init_random_weights(cfg, jax.random.key(0))
    speed = measure.table_host_speed(table, w, cfg)
    assert speed.reference == table.metadata.extra["host_reference_s"] and speed.calls >= 3
    other = dataclasses.replace(table.metadata, extra={**table.metadata.extra, "host_reference": "something else"})
    speed = measure.table_host_speed(SPSTable(table.points, other, table.cost_model), w, cfg)
    with pytest.raises(ValueError, match="no probe yet"):
        speed.reference
    speed.probe()
    assert speed.reference == speed.probes[0] > 0



def test_timed_jobs_drop_programs_between_groups(monkeypatch):
    """Compiled programs are dropped where the group changes (not within a group), and the host-speed reference
    program is compiled again before its next probe, so no probe times a compilation."""
    events = []
    monkeypatch.setattr(jax, "clear_caches", lambda: events.append("clear"))

    class Speed:
        def warm(self):
            events.append("warm")

        def probe(self):
            events.append("probe")
            return 0

        def factor(self, span):
            return 1.0

    def run(job):
        events.append(job)
        from dspark_jax.timing import Timing

        return Timing(median=1.0, p25=1.0, p75=1.0, repeats=1)

    jobs = [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("a", 3)]
    measure.timed_jobs(jobs, run, Speed(), group=lambda job: job[0])
    assert events == ["probe", ("a", 1), "probe", ("a", 2), "clear", "warm", "probe", ("b", 1), "probe", ("b", 2),
                      "clear", "warm", "probe", ("a", 3), "probe"]
    events.clear()
    measure.timed_jobs(jobs, run, None)
    assert "clear" not in events


def test_the_profiler_defaults_to_the_engine_s_window_rule():
    """A table profiled with the defaults is one the default engine takes (one source for the rule)."""
    import inspect

    from dspark_jax.engine import EngineConfig
    from dspark_jax.measure import profile_sps_table
    from profiling import profile_sps

    assert inspect.signature(profile_sps_table).parameters["window_rule"].default == EngineConfig().window_rule
    assert profile_sps.parse_args([]).window_rule == EngineConfig().window_rule
