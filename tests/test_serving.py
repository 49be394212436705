"""The closed-loop load generator, scheduling quality on recorded rounds, and the serving benchmark script."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax import scheduler
from dspark_jax.engine import RoundStats, StepOutput
from dspark_jax.serving import pooled_ratio, scheduling_quality
from dspark_jax.sps import SPSPoint, SPSTable


def _round(conf):
    conf = np.asarray(conf, np.float32)
    r = len(conf)
    return RoundStats(active=r, scheduled=np.zeros(r, int), accepted=np.zeros(r, int), emitted=r, batch_tokens=r,
                      padded_tokens=r, seconds=0.1, compiled=False, confidences=conf, drafted=True, context=100)


def test_scheduling_quality_monotone_table_is_exact():
    """Steps/s falling smoothly (time linear in B): the path's throughput is unimodal, first drop = argmax."""
    table = SPSTable([SPSPoint(b, 1.0 / (0.05 + 0.002 * b)) for b in (1, 8, 32, 128)])
    rng = np.random.default_rng(0)
    rounds = [_round(rng.uniform(0.05, 1.0, size=(4, 5))) for _ in range(30)]
    q = scheduling_quality(rounds, table)
    assert q["rounds"] == 30
    assert q["mean_ratio"] == pytest.approx(1.0, abs=1e-6) and q["share_equal"] == 1.0


def test_scheduling_quality_jagged_table_reports_the_gap():
    """A table with a dip then a recovery: first drop stops at the dip, the argmax walks past it; the report
    gives the same ratio as computing both schedules by hand, and rounds without drafts are skipped."""
    table = SPSTable([SPSPoint(1, 20.0), SPSPoint(2, 10.0), SPSPoint(3, 19.5), SPSPoint(8, 19.0)])
    conf = np.full((1, 6), 0.99, np.float32)
    sps = table.to_dense()
    first = float(scheduler.schedule(conf, sps).throughput)
    best = float(scheduler.schedule(conf, sps, stop="argmax").throughput)
    assert first < 0.98 * best
    skipped = dict(vars(_round(conf)), drafted=False)
    q = scheduling_quality([_round(conf), RoundStats(**skipped)], table)
    assert q["rounds"] == 1
    assert q["min_ratio"] == pytest.approx(first / best, rel=1e-5)
    assert q["share_within_2pct"] == 0.0


@pytest.mark.slow
def test_bench_serving_rows_and_ratios(target, tmp_path, monkeypatch):
    """The benchmark script end to end on a tiny grid (a small random target with the real tokenizer and
    vocabulary, random drafter: the script's plumbing, not the model, is under test): every (policy, N, T)
    row carries the documented fields, ratios are against `none` and the best fixed K of the same run, the
    threshold policy uses the best C of its sweep, policies are interleaved round by round with per-window
    ratios, and the figures are written."""
    from profiling import bench_serving
    from tests.helpers import save_random_drafter, small_real_vocab_target

    small = small_real_vocab_target(target)
    monkeypatch.setattr(bench_serving, "load_target", lambda model=None, dtype=None, mesh=None: small)
    save_random_drafter(small.cfg, tmp_path / "drafter", block=7)
    out = tmp_path / "serving.json"
    bench_serving.main([
        "--draft", str(tmp_path / "drafter"), "--concurrency", "1", "2", "--temperatures", "0",
        "--policies", "none", "fixed:1", "fixed:3", "threshold", "dspark", "--thresholds", "0.2", "0.9",
        "--threshold-sweep-at", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "96",
        "--warmup-rounds", "1", "--rounds", "3", "--min-window-tokens", "8", "--repeats", "2", "--json", str(out), "--plots", str(tmp_path / "fig"),
        "--control",
    ])
    report = json.loads(out.read_text())
    rows = [r for r in report["rows"] if not r.get("threshold_sweep")]
    sweep = [r for r in report["rows"] if r.get("threshold_sweep")]
    policies = ("none", "fixed:1", "fixed:3", "threshold:best", "dspark", "none-control")
    assert {(r["policy"], r["concurrency"]) for r in rows} == {(p, n) for p in policies for n in (1, 2)}
    assert {r["policy"] for r in sweep} == {"threshold:0.2", "threshold:0.9"}
    best_c = max(sweep, key=lambda r: r["tokens_per_s"])["policy"]
    for n in (1, 2):
        point = {r["policy"]: r for r in rows if r["concurrency"] == n}
        for r in point.values():
            for field in ("tokens_per_s", "tokens_per_s_per_user", "accept_len", "drafts_per_request",
                          "rejected_share", "temperature"):
                assert field in r, field
            assert r["tokens_per_s"] > 0
            assert r["tokens_per_s_per_user"] == pytest.approx(r["tokens_per_s"] / n)
            assert r["ratio_vs_none"] == pytest.approx(r["tokens_per_s"] / point["none"]["tokens_per_s"])
            # interleaved (the default): window k of every policy ran side by side, so ratios pair by window
            assert len(r["repeats"]) == 2
            assert r["ratio_vs_none_repeats"] == pytest.approx(
                [a / b for a, b in zip(r["repeats"], point["none"]["repeats"])])
            assert r["ratio_vs_none_paired"] == pytest.approx(float(np.median(r["ratio_vs_none_repeats"])))
            # over all windows: tokens over seconds against none's, inside its bootstrap interval
            assert r["ratio_vs_none_pooled"] == pytest.approx(
                (sum(r["window_emitted"]) / sum(r["window_seconds"]))
                / (sum(point["none"]["window_emitted"]) / sum(point["none"]["window_seconds"])))
            lo, hi = r["ratio_vs_none_ci"]
            assert lo <= r["ratio_vs_none_pooled"] * (1 + 1e-9) and r["ratio_vs_none_pooled"] <= hi * (1 + 1e-9)
            assert r["repeats"] == pytest.approx([e / t for e, t in zip(r["window_emitted"], r["window_seconds"])])
        # the best fixed K is the fastest over all windows (interleaved), and every ratio is against it
        best_fixed = max((point["fixed:1"], point["fixed:3"]), key=lambda r: r["tokens_per_s_pooled"])
        assert point["dspark"]["best_fixed"] == best_fixed["policy"]
        assert point["dspark"]["ratio_vs_best_fixed"] == pytest.approx(
            point["dspark"]["tokens_per_s"] / best_fixed["tokens_per_s"])
        assert point["dspark"]["ratio_vs_best_fixed_pooled"] == pytest.approx(
            point["dspark"]["tokens_per_s_pooled"] / best_fixed["tokens_per_s_pooled"])
        assert point["threshold:best"]["threshold"] == best_c
        assert point["none"]["drafts_per_request"] == 0 and point["none"]["accept_len"] == pytest.approx(1.0)
        # the control is a second plain-decoding engine: its ratio to `none` is the noise floor
        control = point["none-control"]
        assert control["drafts_per_request"] == 0 and control["admissions"] == {"context": 0, "no_context": 0}
        assert control["ratio_vs_none"] == pytest.approx(control["tokens_per_s"] / point["none"]["tokens_per_s"])
        assert isinstance(point["dspark"]["drafter_offs"], list) and sum(point["dspark"]["admissions"].values()) >= n
        if n == 1:  # a window runs until 8 tokens came out (the floor over 3 x N), at most 2 per round here
            assert point["none"]["steady_rounds"] + point["none"]["compiled_rounds"] >= 4
        # Drafts are capped by each request's remaining token budget, never raised.
        assert 0.0 < point["fixed:3"]["drafts_per_request"] <= 3.0
        assert point["fixed:1"]["drafts_per_request"] <= 1.0
    # Scheduling quality is computed on every drafted round of every drafting policy at each load.
    assert set(report["scheduling_quality"]) == {"N=1 T=0", "N=2 T=0"}
    for q in report["scheduling_quality"].values():
        assert q["rounds"] >= 3 and 0.0 < q["min_ratio"] <= q["mean_ratio"] <= 1.0 + 1e-6
    assert sorted(p.name for p in (tmp_path / "fig").glob("*.png"))
    assert report["complete"] is True
    # --recompute derives the same ratios from the windows the report recorded, and measures nothing
    monkeypatch.setattr(bench_serving, "load_target", None)
    bench_serving.main(["--recompute", "--json", str(out), "--plots", str(tmp_path / "again")])
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert sorted(p.name for p in (tmp_path / "again").glob("*.png")) == sorted(
        p.name for p in (tmp_path / "fig").glob("*.png"))
    monkeypatch.setattr(bench_serving, "load_target", lambda model=None, dtype=None, mesh=None: small)
    with pytest.raises(ValueError, match="--recompute needs --json"):
        bench_serving.main(["--recompute"])

    # Interrupted after the first load: --resume keeps its rows and the sweep, and measures only the rest.
    argv = ["--draft", str(tmp_path / "drafter"), "--concurrency", "1", "2", "--temperatures", "0",
            "--policies", "none", "fixed:1", "fixed:3", "threshold", "dspark", "--thresholds", "0.2", "0.9",
            "--threshold-sweep-at", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "96",
            "--warmup-rounds", "1", "--rounds", "3", "--min-window-tokens", "8", "--control", "--repeats", "2",
            "--json", str(out)]
    kept = [r for r in report["rows"] if r.get("threshold_sweep") or r["concurrency"] == 1]
    out.write_text(json.dumps({"rows": kept, "complete": False, "args": report["args"]}))
    measured = []
    monkeypatch.setattr(bench_serving, "closed_loop", lambda *a, **k: measured.append("sweep"))  # must not run
    real = bench_serving.interleaved
    monkeypatch.setattr(bench_serving, "interleaved",
                        lambda engines, prompts, n, *a, **k: measured.append(n) or real(engines, prompts, n, *a, **k))
    bench_serving.main(argv + ["--resume"])  # the point of 2 users: its untimed first run, then the timed one
    resumed = json.loads(out.read_text())
    assert measured == [2, 2] and resumed["complete"] is True and resumed["resumed_points"] == len(kept) - 2
    assert resumed["rows"][:len(kept)] == kept
    assert {(r["policy"], r["concurrency"]) for r in resumed["rows"] if not r.get("threshold_sweep")} == {
        (p, n) for p in policies for n in (1, 2)}
    with pytest.raises(ValueError, match=r"other settings \(repeats=2, now 3\)"):
        bench_serving.main([*argv[:-3], "3", "--json", str(out), "--resume"])
    with pytest.raises(ValueError, match="--resume needs --json"):
        bench_serving.main(["--resume"])


def test_pooled_ratio_and_its_paired_interval():
    """The pooled ratio is total tokens over total seconds against the reference's; its bootstrap interval
    is the percentile range of resampled windows (a window keeps both engines' times), so a window whose
    content makes both engines slow moves neither end, and identical engines give exactly 1."""
    e, t = [100, 100, 100, 100], [1.0, 2.0, 4.0, 1.0]
    assert pooled_ratio(e, t, e, t) == pytest.approx((1.0, 1.0, 1.0))
    # A is 1.25 x B in every window, whatever the window's content does to both
    ratio, lo, hi = pooled_ratio(e, [x / 1.25 for x in t], e, t)
    assert (ratio, lo, hi) == pytest.approx((1.25, 1.25, 1.25))
    # A is faster in two windows and slower in two: the interval holds the pooled ratio and is wide
    a_t = [0.5, 2.0, 5.0, 0.8]
    ratio, lo, hi = pooled_ratio(e, a_t, e, t)
    assert ratio == pytest.approx(sum(t) / sum(a_t)) and lo < ratio < hi
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 4, size=(4000, 4))  # the same draws as the function's seed 0
    boot = np.asarray(t)[idx].sum(1) / np.asarray(a_t)[idx].sum(1)
    assert (lo, hi) == pytest.approx(tuple(np.quantile(boot, [0.025, 0.975])))
    with pytest.raises(ValueError, match="one length"):
        pooled_ratio([1, 2], [1.0], [1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="seconds > 0"):
        pooled_ratio([1], [0.0], [1], [1.0])


def _timed_round(emitted, seconds, compiled=False, scheduled=(0,), accepted=(0,)):
    return RoundStats(active=len(scheduled), scheduled=np.asarray(scheduled), accepted=np.asarray(accepted),
                      emitted=emitted, batch_tokens=1, padded_tokens=1, seconds=seconds, compiled=compiled)


def test_windows_summarize():
    """Tokens/s per window over the rounds that compiled nothing, median and half-range over windows."""
    from dspark_jax.serving import summarize_windows

    w1 = [_timed_round(10, 1.0), _timed_round(99, 5.0, compiled=True), _timed_round(10, 1.0, scheduled=(3,), accepted=(1,))]
    w2 = [_timed_round(30, 1.0)]
    w3 = [_timed_round(5, 0.5), _timed_round(15, 0.5)]
    res = summarize_windows([w1, w2, w3], completed_requests=4)
    assert res.repeats == [10.0, 30.0, 20.0] and res.tokens_per_s == 20.0 and res.tokens_per_s_spread == 10.0
    assert res.steady_rounds == 5 and res.compiled_rounds == 1 and res.completed_requests == 4
    assert res.drafts_per_request == pytest.approx(3 / 5) and res.rejected_share == pytest.approx(2 / 3)
    assert res.accept_len == pytest.approx(6 / 5)


class _FakeEngine:
    """Engine stand-in: each request needs len(prompt) tokens, each round emits ``rate`` tokens per request
    (fewer at the end of one)."""

    def __init__(self, name, rate, slots=4):
        import types

        self.name, self.rate = name, rate
        self.cfg = types.SimpleNamespace(num_slots=slots)
        self.left, self.finished_ids, self.next_id = {}, [], 0

    def submit(self, prompt, max_new_tokens):
        self.left[self.next_id] = min(len(prompt), max_new_tokens)
        self.next_id += 1
        return self.next_id - 1

    def step(self):
        if not self.left:
            return StepOutput()
        total = 0
        for rid in list(self.left):
            k = min(self.rate, self.left[rid])
            total += k
            self.left[rid] -= k
            if self.left[rid] == 0:
                del self.left[rid]
                self.finished_ids.append(rid)
        return StepOutput(stats=_timed_round(total, 0.01 * self.rate))


def test_windows_end_at_the_same_token_counts_for_every_engine(monkeypatch):
    """Each window ends at the first round that brings the loop's emitted tokens to warmup + (k + 1) x window,
    whatever tokens per round the engine emits; the engines take turns in an order rotated every repeat;
    bad sizes are refused."""
    from dspark_jax import serving

    prompts = [[0] * n for n in (5, 9, 3, 12, 7)]
    calls = []
    run_until = serving.ClosedLoop.run_until

    def recording(loop, total):
        before = loop.emitted
        rounds = run_until(loop, total)
        calls.append((loop.engine.name, total, before, loop.emitted, rounds[-1].emitted))
        return rounds

    monkeypatch.setattr(serving.ClosedLoop, "run_until", recording)
    engines = {"slow": _FakeEngine("slow", 1), "fast": _FakeEngine("fast", 3)}
    res = serving.interleaved(engines, prompts, 2, 8, warmup_tokens=4, window_tokens=10, repeats=3, turns="window")
    assert [(name, total) for name, total, *_ in calls] == [
        ("slow", 4), ("fast", 4),  # warm-up
        ("slow", 14), ("fast", 14), ("fast", 24), ("slow", 24), ("slow", 34), ("fast", 34)]
    for name, total, before, after, last in calls:
        assert after >= total > after - last  # the first round to reach the target ends the window
    for name in engines:
        windows = [after - before for n, total, before, after, _ in calls[2:] if n == name]
        assert len(res[name].repeats) == 3
        assert sum(r.emitted for r in res[name].rounds) == sum(windows)
    assert serving.window_tokens(16, 24, 96) == 384 and serving.window_tokens(1, 24, 96) == 96
    with pytest.raises(ValueError, match="window_tokens"):
        serving.window_tokens(0, 24)
    with pytest.raises(ValueError, match="window_tokens >= 1"):
        serving.interleaved(engines, prompts, 2, 8, warmup_tokens=0, window_tokens=0)
    with pytest.raises(ValueError, match="turns"):
        serving.interleaved(engines, prompts, 2, 8, warmup_tokens=0, window_tokens=4, turns="step")


def test_engines_take_turns_round_by_round(monkeypatch):
    """The default turns: one round of each engine per cycle inside a window, in an order drawn every cycle (an
    engine past the window's end waits), each window ending at the first round that reaches warmup + (k + 1) x
    window tokens, as with whole windows."""
    from dspark_jax import serving

    prompts = [[0] * n for n in (5, 9, 3, 12, 7)]
    order = []
    step = serving.ClosedLoop.step

    def recording(loop):
        stats = step(loop)
        order.append((loop.engine.name, loop.emitted, stats.emitted if stats is not None else 0))
        return stats

    monkeypatch.setattr(serving.ClosedLoop, "step", recording)
    engines = {"slow": _FakeEngine("slow", 1), "fast": _FakeEngine("fast", 3)}
    res = serving.interleaved(engines, prompts, 2, 8, warmup_tokens=4, window_tokens=10, repeats=2)
    after_warmup = order[[n for n, *_ in order].index("fast"):]  # the slow loop warms up first, then the fast one
    measured = [x for x in after_warmup if x[1] - x[2] >= 4]  # rounds that started after the loop's warm-up
    names = [n for n, *_ in measured]
    # both step in turn while both are inside the window; then the slow one alone finishes it
    assert sorted(names[:2]) == sorted(names[2:4]) == ["fast", "slow"] and names[4:6] == ["slow", "slow"], names
    for name in engines:
        emitted = [(e, k) for n, e, k in measured if n == name]
        ends = [e for e, k in emitted if e >= 14 and e - k < 14] + [e for e, k in emitted if e >= 24 and e - k < 24]
        assert len(ends) == 2  # one round closes each window
        assert len(res[name].repeats) == 2
        assert sum(r.emitted for r in res[name].rounds) == sum(k for _, k in emitted)
