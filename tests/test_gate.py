"""The drafter gate's pure functions (`dspark_jax.gate`) against NumPy references, on tiny arrays."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import gate, scheduler
from dspark_jax.engine import EngineConfig
from dspark_jax.models.llama import BUCKETS
from dspark_jax.sps import plain_sps_from_cost, sps_from_cost
from tests.helpers import synthetic_cost_table

G = 4


@pytest.mark.parametrize("field, bad", [
    ("probe_every", 0), ("probe_every", 2.5), ("probe_budget", 0.0), ("probe_budget", float("nan")),
    ("margin", -0.1), ("margin", float("nan")), ("margin", float("inf")), ("fill", 1), ("off_after", 0),
    ("off_after", 2.5), ("off_requests", 0), ("off_requests", 1.5), ("off_retry", 0), ("calibrate_times", None),
    ("request_ema", 0.0), ("global_ema", 1.5),
    ("accept_decay", -1.0), ("time_ema", float("nan")), ("accept_prior", 0.0),
])
def test_config_is_validated_where_declared(field, bad):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        gate.GateConfig(**{field: bad})


def test_engine_config_holds_one_gate_config():
    """EngineConfig takes the gate's settings as one `GateConfig` (its defaults the gate's own, hashable with the
    rest) and refuses anything else under the name ``gate``; a bad value is refused where it is declared."""
    assert EngineConfig().gate == gate.GateConfig()
    g = gate.GateConfig(probe_every=3, probe_budget=0.5, margin=0.1, fill=False, off_after=None, off_requests=2,
                        off_retry=7, calibrate_times=False)
    cfg = EngineConfig(gate=g)
    assert cfg.gate is g
    hash(cfg)  # hashable: a static argument of jit
    assert EngineConfig(gate=gate.GateConfig(margin=0.1)) == EngineConfig(gate=gate.GateConfig(margin=0.1))
    for bad in (None, {"margin": 0.1}, 0.1):
        with pytest.raises(ValueError, match="^gate: expected a dspark_jax.GateConfig"):
            EngineConfig(gate=bad)
    from dspark_jax import GateConfig
    assert GateConfig is gate.GateConfig  # exported at the top level


def test_init_and_admit():
    s = gate.init(gate.GateConfig(accept_prior=2.0), 3, G, 0.5)
    prior = 0.5 ** np.arange(1, G + 1)
    np.testing.assert_allclose(s.survival, np.broadcast_to(prior, (3, G)))
    np.testing.assert_allclose(s.global_survival, prior)
    np.testing.assert_allclose(s.accept_seen, [2.0, 2.0])
    assert int(s.skipped) == 0 and s.skipped.dtype == jnp.int32
    s = s._replace(global_survival=jnp.array([0.9, 0.5, 0.2, 0.1], jnp.float32))
    t = jax.jit(gate.admit)(s, jnp.int32(1))  # a joining request starts from the engine-wide average
    np.testing.assert_allclose(t.survival[1], [0.9, 0.5, 0.2, 0.1])
    np.testing.assert_allclose(np.asarray(t.survival)[[0, 2]], np.asarray(s.survival)[[0, 2]])
    with pytest.raises(ValueError, match="prior_confidence"):
        gate.init(gate.GateConfig(), 3, G, 1.5)


def _update_reference(state, cfg, rows, valid, conf, lengths, accepted, drafted):
    """The bookkeeping, in NumPy, row by row."""
    surv_avg = np.array(state.survival, np.float64)
    glob = np.array(state.global_survival, np.float64)
    seen = np.array(state.accept_seen, np.float64)
    skipped = int(state.skipped)
    if not drafted:
        return surv_avg, glob, seen, skipped + 1
    surv = np.cumprod(conf, axis=1)
    for r, slot in enumerate(rows):
        if valid[r]:
            surv_avg[slot] = cfg.request_ema * surv[r] + (1 - cfg.request_ema) * np.asarray(state.survival)[slot]
    if valid.any():
        glob = cfg.global_ema * surv[valid].mean(0) + (1 - cfg.global_ema) * glob
    predicted = sum(surv[r, :lengths[r]].sum() for r in range(len(rows)) if valid[r])
    got = sum(accepted[r] for r in range(len(rows)) if valid[r])
    if predicted > 0:
        seen = cfg.accept_decay * seen + [predicted, got]
    return surv_avg, glob, seen, 0


@pytest.mark.parametrize("drafted", [True, False])
@pytest.mark.parametrize("valid", [[True, True, False], [False, False, False], [True, False, True]])
def test_update_matches_numpy(drafted, valid):
    rng = np.random.default_rng(0)
    cfg = gate.GateConfig()
    s = gate.init(cfg, 4, G, 0.7)._replace(
        survival=jnp.asarray(np.sort(rng.uniform(size=(4, G)), axis=1)[:, ::-1], jnp.float32),
        skipped=jnp.int32(3))
    rows = np.array([2, 0, 3], np.int32)
    valid = np.array(valid)
    conf = rng.uniform(size=(3, G)).astype(np.float32)
    lengths = np.array([4, 1, 0], np.int32)
    accepted = np.array([2, 1, 0], np.int32)
    want = _update_reference(s, cfg, rows, valid, conf, lengths, accepted, drafted)
    for fn in (gate.update, jax.jit(gate.update, static_argnums=1)):
        got = fn(s, cfg, jnp.asarray(rows), jnp.asarray(valid), jnp.asarray(conf), jnp.asarray(lengths),
                 jnp.asarray(accepted), jnp.bool_(drafted))
        np.testing.assert_allclose(got.survival, want[0], rtol=1e-6)
        np.testing.assert_allclose(got.global_survival, want[1], rtol=1e-6)
        np.testing.assert_allclose(got.accept_seen, want[2], rtol=1e-6)
        assert int(got.skipped) == want[3]


def _one_row(cfg, survival, accept_seen=(4.0, 4.0)):
    s = gate.init(cfg, 2, G, 0.7)
    return s._replace(survival=s.survival.at[0].set(survival), accept_seen=jnp.asarray(accept_seen, jnp.float32))


ROWS, VALID, CONTEXT, SCALE = jnp.array([0]), jnp.array([True]), jnp.array([0]), jnp.ones(2, jnp.float32)


def test_decide_opens_when_the_estimate_beats_the_margin():
    """A free drafter with certain drafts opens the gate; an impossible margin, or verification having
    accepted nothing of what the confidences predicted, keeps it shut."""
    cost = synthetic_cost_table(draft_cost=0.0).cost_arrays()
    cfg = gate.GateConfig(probe_every=1000)
    decide = jax.jit(gate.decide, static_argnums=1)
    opens, sps, gain = decide(_one_row(cfg, 1.0), cfg, cost, ROWS, VALID, CONTEXT, SCALE)
    assert bool(opens) and float(gain) > 1.05
    np.testing.assert_allclose(sps, sps_from_cost(cost, 1, 0))
    assert not bool(decide(_one_row(cfg, 1.0, (4.0, 0.0)), cfg, cost, ROWS, VALID, CONTEXT, SCALE)[0])
    high = gate.GateConfig(probe_every=1000, margin=float(gain))  # the bar just at the estimate: shut
    assert not bool(decide(_one_row(high, 1.0), high, cost, ROWS, VALID, CONTEXT, SCALE)[0])
    # a drafting round measured far slower than the table says closes it too
    assert not bool(decide(_one_row(cfg, 1.0), cfg, cost, ROWS, VALID, CONTEXT, jnp.array([50.0, 1.0]))[0])


def test_probes_are_spaced_by_their_expected_loss():
    """A closed gate probes once ``skipped`` reaches max(probe_every, ceil(loss / probe_budget)), the loss
    ``(t_draft / t_plain) * max(1 + margin - gain, 0)``: the closer the estimate to the bar, the sooner."""
    cost = synthetic_cost_table(draft_cost=0.01).cost_arrays()
    cfg = gate.GateConfig()

    @jax.jit
    def wait(p):  # skipped rounds before the gate opens, for survival p, p^2, ... at every position
        st = _one_row(cfg, p ** jnp.arange(1, G + 1))
        opens = jax.vmap(lambda k: gate.decide(st._replace(skipped=k), cfg, cost, ROWS, VALID, CONTEXT,
                                               SCALE)[0])(jnp.arange(4096, dtype=jnp.int32))
        return jnp.argmax(opens)

    waits = [int(wait(p)) for p in np.linspace(0.0, 1.0, 101)]
    assert waits == sorted(waits, reverse=True) and waits[-1] == 0, waits
    assert 2 in waits, waits  # just below the bar: the floor
    t_draft = 1 / sps_from_cost(cost, 1, 0)[int(scheduler.padded_batch(jnp.int32(1), BUCKETS))]
    t_plain = 1 / plain_sps_from_cost(cost, 1, 0)
    assert waits[0] == max(2, int(np.ceil(float(1.05 * t_draft / t_plain - 1) / 0.02 - 1e-4))), waits


def test_conditional_reads_survival_back_as_confidences():
    surv = jnp.array([[0.8, 0.4, 0.4, 0.0], [1.0, 0.5, 0.25, 0.125]], jnp.float32)
    np.testing.assert_allclose(gate.conditional(surv), [[0.8, 0.5, 1.0, 0.0], [1.0, 0.5, 0.5, 0.5]])
    np.testing.assert_allclose(jnp.cumprod(gate.conditional(surv), axis=1), surv)
    assert not np.any(np.isnan(gate.conditional(jnp.zeros((1, 4)))))


def test_cutoff_counts_request_rounds_per_bucket_and_retries():
    cfg = gate.GateConfig(off_after=5, off_retry=3, margin=0.05)
    cut = gate.CutOff()
    cut, off = gate.cutoff_update(cut, cfg, 2, 2, 2, 0.9, True)  # below the bar: 2 request-rounds
    cut, off = gate.cutoff_update(cut, cfg, 4, 3, 3, 0.5, True)  # another bucket counts apart
    assert not off and cut.below_bar == {2: 2, 4: 3}
    cut, off = gate.cutoff_update(cut, cfg, 2, 2, 2, 1.06, True)  # above 1 + margin: the count resets
    assert cut.below_bar[2] == 0 and not off
    for gain, left in ((math.nan, 2), (0.5, 0)):  # the gate did not look, or looked at nobody: no count
        same, off = gate.cutoff_update(cut, cfg, 2, 2, left, gain, True)
        assert same == cut and not off
    before = cut
    cut, off = gate.cutoff_update(cut, cfg, 4, 2, 2, 1.05, True)  # at the bar is below it: 5 >= off_after
    assert off and gate.drafter_off(cut, 4) and not gate.drafter_off(cut, 2)
    assert before.off_rounds == {}  # never mutated
    cut, off = gate.cutoff_update(cut, cfg, 4, 2, 2, 2.0, True)  # off: drafting rounds do not count
    assert cut.off_rounds == {4: 0} and not off
    for _ in range(3):  # off_retry rounds without the drafter: tried again, its count forgotten
        cut, off = gate.cutoff_update(cut, cfg, 4, 2, 2, math.nan, False)
    assert not gate.drafter_off(cut, 4) and 4 not in cut.below_bar and cut.below_bar == {2: 0}
    never = gate.GateConfig(off_after=None)
    assert gate.cutoff_update(gate.CutOff(), never, 1, 100, 100, 0.0, True) == (gate.CutOff(), False)


def test_cutoff_needs_evidence_from_distinct_requests():
    """One long answer below the bar is not enough at one user: each request counts at most its share
    (ceil(off_after / off_requests) rounds) and ``off_requests`` distinct requests must be seen; a busy engine
    sees them in its first rounds. An estimate above the bar forgets the requests with the count."""
    cfg = gate.GateConfig(off_after=6, off_requests=3)  # a request's share: 2 request-rounds
    cut = gate.CutOff()
    for _ in range(10):  # one user, one long answer: 10 request-rounds, 2 of them count
        cut, off = gate.cutoff_update(cut, cfg, 1, 1, 1, 0.5, True, requests=[5])
        assert not off
    for rid in (6, 7):  # three requests, 2 + 1 + 1 counted: not enough (uncapped, 12 would be)
        cut, off = gate.cutoff_update(cut, cfg, 1, 1, 1, 0.5, True, requests=[rid])
        assert not off
    assert cut.streak_requests[1] == {5: 2, 6: 1, 7: 1} and cut.below_bar[1] == 12
    cut, off = gate.cutoff_update(cut, cfg, 1, 1, 1, 2.0, True, requests=[7])  # opens: all forgotten
    assert cut.below_bar[1] == 0 and cut.streak_requests[1] == {}
    for rid in (7, 7, 8, 8, 9):
        cut, off = gate.cutoff_update(cut, cfg, 1, 1, 1, 0.5, True, requests=[rid])
        assert not off
    cut, off = gate.cutoff_update(cut, cfg, 1, 1, 1, 0.5, True, requests=[9])  # 2 + 2 + 2 from 3 requests
    assert off and gate.drafter_off(cut, 1)
    busy, off = gate.cutoff_update(gate.CutOff(), cfg, 4, 4, 4, 0.5, True, requests=np.arange(4))
    assert not off  # four request-rounds
    busy, off = gate.cutoff_update(busy, cfg, 4, 4, 4, 0.5, True, requests=np.arange(4))
    assert off  # eight, from four requests
    many, off = gate.cutoff_update(gate.CutOff(), cfg, 8, 8, 8, 0.5, True, requests=np.arange(8))
    assert off  # a busy engine: its first round
    unknown, off = gate.cutoff_update(gate.CutOff(), cfg, 4, 6, 6, 0.5, True)  # ids unknown: request-rounds alone
    assert off
    for _ in range(cfg.off_retry):  # the retry forgets the bucket's requests too
        cut, _ = gate.cutoff_update(cut, cfg, 1, 1, 1, math.nan, False)
    assert 1 not in cut.streak_requests and not gate.drafter_off(cut, 1)


def _observe(times, n, drafted, seconds, cfg=gate.GateConfig()):
    for _ in range(n):
        times = gate.observe_round(times, cfg, drafted, seconds, 1.0)
    return times


def test_time_scale_starts_from_the_plain_rounds():
    """Before any drafting round is measured, drafting rounds take the plain rounds' correction; single
    outliers are clipped; rounds without a prediction or a time, or with calibrate_times off, are ignored."""
    t = _observe(gate.RoundTimes(), 1, False, 2.0)
    d, p = gate.time_scale(t)
    assert d == p and p == pytest.approx(math.sqrt(2.0))  # the table counts as one observation
    t = _observe(t, 1, True, 1e6)  # clipped at e^2 per observation
    assert gate.time_scale(t)[0] <= np.exp(2.0) + 1e-9
    cfg = gate.GateConfig()
    assert gate.observe_round(t, cfg, False, 1.0, float("nan")) == t
    assert gate.observe_round(t, cfg, True, 0.0, 1.0) == t
    assert gate.observe_round(t, gate.GateConfig(calibrate_times=False), True, 3.0, 1.0) == t


def test_host_drift_moves_both_round_times():
    """The drafting rounds' excess over the host factor is learned from drafting rounds; host drift seen
    only in plain rounds (a closed gate) then moves the drafting rounds' price too, at the learned ratio."""
    t = gate.RoundTimes()
    for _ in range(60):  # drafting rounds 1.5 x what the table says, plain rounds as it says
        t = _observe(_observe(t, 1, True, 1.5), 1, False, 1.0)
    d, p = gate.time_scale(t)
    assert d == pytest.approx(1.5, rel=0.02) and p == pytest.approx(1.0, rel=0.02)
    t = _observe(t, 60, False, 2.0)  # the host slows down twofold while the gate is closed: plain rounds only
    d, p = gate.time_scale(t)
    assert p == pytest.approx(2.0, rel=0.02) and d / p == pytest.approx(1.5, rel=0.02)
    t = _observe(t, 60, True, 1.5)  # an open gate alone (drafting rounds only) follows the host back down
    assert gate.time_scale(t)[0] == pytest.approx(1.5, rel=0.05)
