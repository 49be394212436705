"""The prefix scheduler against a plain-Python Algorithm 1, on thousands of random cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

from dspark_jax import scheduler
from tests import reference
from tests.helpers import count_compilations

TIE = 1e-5  # relative gap under which float32 rounding may decide a comparison either way


# ----------------------------------------------------------------------------- random inputs
def make_conf(rng, rows, block, kind):
    if kind == "uniform":
        c = rng.uniform(size=(rows, block))
    elif kind == "discrete":  # exact zeros, ones and ties
        c = rng.choice([0.0, 0.25, 0.5, 0.5, 0.75, 1.0, 1.0], size=(rows, block))
    else:  # high, like a good drafter, with some zeros
        c = 1 - rng.beta(0.5, 3.0, size=(rows, block))
        c[rng.uniform(size=c.shape) < 0.05] = 0.0
    return c.astype(np.float32)


def make_sps(rng, n, kind):
    b = np.arange(n, dtype=np.float64)
    if kind == "smooth":  # step time convex and non-decreasing
        t = 0.05 + 0.002 * b + rng.uniform(0, 1e-5) * b**2
    elif kind == "flat":
        t = np.full(n, 0.05)
    elif kind == "jagged":  # bucketed: step time jumps at tile boundaries
        t = 0.05 + 0.01 * np.ceil(np.maximum(b, 1) / rng.choice([4, 8, 16]))
    else:  # noisy measurements
        t = 0.05 + 0.001 * b
        t = t * rng.uniform(0.8, 1.2, size=n)
    return (1.0 / t).astype(np.float32)


SPS_KINDS = ["smooth", "flat", "jagged", "noisy"]
CONF_KINDS = ["uniform", "discrete", "high"]


def check_first_drop(conf, sps, active, got_lengths, got_batch=None):
    lengths, b, tau, theta, gap = reference.algorithm1(conf, sps, active)
    if gap < TIE:
        return False
    np.testing.assert_array_equal(got_lengths, lengths)
    if got_batch is not None:
        assert int(got_batch) == b
    return True


def check_argmax(conf, sps, active, got_lengths):
    lengths, n, best, gap = reference.argmax_rule(conf, sps, active)
    if gap < TIE:
        return False
    np.testing.assert_array_equal(got_lengths, lengths)
    return True


# ----------------------------------------------------------------------------- survival
def test_survival_matches_numpy_cumprod_bitwise():
    rng = np.random.default_rng(0)
    for rows, block in [(1, 1), (15, 7), (16, 16), (17, 3)]:
        conf = make_conf(rng, rows, block, "uniform")
        active = rng.uniform(size=rows) < 0.7
        np.testing.assert_array_equal(scheduler.survival_probs(conf), reference.survival(conf))
        np.testing.assert_array_equal(
            scheduler.survival_probs(conf, active=active), reference.survival(conf, active)
        )


def test_sps_lookup_zero_outside_table():
    sps = jnp.array([5.0, 4.0, 3.0])
    got = scheduler.sps_lookup(sps, jnp.array([-1, 0, 2, 3, 100]))
    np.testing.assert_array_equal(got, [0.0, 5.0, 3.0, 0.0, 0.0])


# ----------------------------------------------------------------------------- thousands of cases (vmapped)
@pytest.mark.parametrize("rows,block,n_table", [(1, 4, 8), (3, 7, 16), (8, 4, 20), (16, 16, 300), (17, 7, 64)])
def test_first_drop_and_argmax_match_reference_batched(rows, block, n_table):
    rng = np.random.default_rng(rows * 1000 + block)
    cases = 400
    conf = np.stack([make_conf(rng, rows, block, CONF_KINDS[i % 3]) for i in range(cases)])
    sps = np.stack([make_sps(rng, n_table, SPS_KINDS[i % 4]) for i in range(cases)])
    active = rng.uniform(size=(cases, rows)) < 0.8
    first = jax.vmap(lambda c, s, a: scheduler.schedule(c, s, active=a))(conf, sps, active)
    best = jax.vmap(lambda c, s, a: scheduler.schedule(c, s, active=a, stop="argmax"))(conf, sps, active)
    checked = 0
    for i in range(cases):
        checked += check_first_drop(conf[i], sps[i], active[i], first.lengths[i], first.batch_tokens[i])
        checked += check_argmax(conf[i], sps[i], active[i], best.lengths[i])
    assert checked > 1.8 * cases  # near-ties are rare
    # Argmax never does worse than the first drop on the path it searches.
    assert np.all(np.asarray(best.throughput) >= np.asarray(first.throughput) * (1 - 1e-6))


def test_expected_tokens_and_throughput_consistent():
    rng = np.random.default_rng(5)
    conf = make_conf(rng, 12, 7, "high")
    sps = make_sps(rng, 64, "smooth")
    s = scheduler.schedule(conf, sps)
    a = reference.survival(conf)
    lengths = np.asarray(s.lengths)
    tau = 12 + sum(a[r, :lengths[r]].sum() for r in range(12))
    np.testing.assert_allclose(float(s.expected_tokens), tau, rtol=1e-5)
    assert int(s.batch_tokens) == 12 + lengths.sum()
    np.testing.assert_allclose(float(s.throughput), tau * sps[int(s.batch_tokens)], rtol=1e-5)


# ----------------------------------------------------------------------------- large, staged path (not vmapped)
@pytest.mark.parametrize("rows,block,n_table", [(64, 16, 2049), (64, 16, 200), (40, 7, 4000), (256, 4, 400)])
def test_staged_ranking_matches_reference(rows, block, n_table):
    rng = np.random.default_rng(rows + block + n_table)
    checked = 0
    for i in range(12):
        conf = make_conf(rng, rows, block, CONF_KINDS[i % 3])
        sps = make_sps(rng, n_table, SPS_KINDS[i % 4])
        active = rng.uniform(size=rows) < 0.9
        s = scheduler.schedule(conf, sps, active=active)
        checked += check_first_drop(conf, sps, active, s.lengths, s.batch_tokens)
        m = scheduler.schedule(conf, sps, active=active, stop="argmax")
        checked += check_argmax(conf, sps, active, m.lengths)
        assert int(scheduler.capacity(conf, sps, active=active)) == int(m.batch_tokens) - active.sum()
    assert checked >= 20


# ----------------------------------------------------------------------------- hypothesis: edge cases
SHAPES = [(1, 1), (2, 3), (5, 4), (4, 7)]


@st.composite
def cases(draw):
    rows, block = draw(st.sampled_from(SHAPES))
    values = st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.9, 0.1]) | st.floats(0, 1, width=32)
    conf = np.array(draw(st.lists(values, min_size=rows * block, max_size=rows * block)), np.float32)
    active = np.array(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    n_table = draw(st.sampled_from([2, 6, 12, 40]))
    steps = draw(st.lists(st.floats(0.01, 1.0), min_size=n_table, max_size=n_table))
    return conf.reshape(rows, block), (1.0 / np.array(steps)).astype(np.float32), active


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_hypothesis_first_drop_matches_algorithm1(case):
    conf, sps, active = case
    s = scheduler.schedule(conf, sps, active=active)
    check_first_drop(conf, sps, active, s.lengths, s.batch_tokens)
    assert np.all(np.asarray(s.lengths)[~active] == 0)
    a = reference.survival(conf)
    # zero-survival drafts are never admitted
    for r, l in enumerate(np.asarray(s.lengths)):
        assert l == 0 or a[r, l - 1] > 0
    m = scheduler.schedule(conf, sps, active=active, stop="argmax")
    check_argmax(conf, sps, active, m.lengths)


@settings(max_examples=200, deadline=None)
@given(cases(), st.integers(0, 40))
def test_hypothesis_top_k_lengths(case, k):
    conf, _, active = case
    got = np.asarray(scheduler.top_k_lengths(conf, jnp.int32(k), active=active))
    a = reference.survival(conf, active)
    order = sorted(
        [(r, j) for r in range(a.shape[0]) for j in range(a.shape[1]) if a[r, j] > 0], key=lambda rj: -float(a[rj])
    )
    want = np.zeros(a.shape[0], int)
    for r, j in order[:k]:
        want[r] = j + 1
    np.testing.assert_array_equal(got, want)


BUCKETS = np.array([1, 2, 4, 8, 16, 32, 64], np.int32)


def ranked_prefix(a, k):
    """Lengths when the top ``k`` positive-survival candidates (row-major ties) are admitted."""
    order = sorted([(r, j) for r in range(a.shape[0]) for j in range(a.shape[1]) if a[r, j] > 0],
                   key=lambda rj: -float(a[rj]))
    want = np.zeros(a.shape[0], int)
    for r, j in order[:k]:
        want[r] = j + 1
    return want


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_hypothesis_fill_to_bucket(case):
    """The fill extends the first-drop schedule to the next ranked candidates until the padded batch is full
    (or no candidate is left), and leaves a schedule without drafts alone."""
    conf, sps, active = case
    s = scheduler.schedule(conf, sps, active=active)
    got = np.asarray(scheduler.fill_to_bucket(conf, s.lengths, BUCKETS, active=active))
    base = np.asarray(s.lengths)
    assert np.all(got >= base) and np.all(got[~active] == 0)
    r_act, drafts = int(active.sum()), int(base.sum())
    if drafts == 0:
        np.testing.assert_array_equal(got, base)
        return
    padded = int(BUCKETS[np.searchsorted(BUCKETS, r_act + drafts)])
    a = reference.survival(conf, active)
    np.testing.assert_array_equal(got, ranked_prefix(a, padded - r_act))
    assert r_act + got.sum() == padded or got.sum() == int((a > 0).sum())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_hypothesis_admission_never_looks_at_its_own_draft(case, data):
    """Lossless scheduling: whether draft ``(r, k)`` is verified may not change when the confidences that
    can depend on it (``c[r, k+1..]``) change. Holds for the first drop with and without the fill, and for
    a top-K whose K is fixed; the argmax over fresh confidences breaks it (spec appendix A)."""
    conf, sps, active = case
    rows, block = conf.shape
    r = data.draw(st.integers(0, rows - 1))
    k = data.draw(st.integers(1, block))  # 1-based draft position
    other = conf.copy()
    other[r, k:] = np.array(data.draw(st.lists(st.floats(0, 1, width=32), min_size=block - k,
                                               max_size=block - k)), np.float32)
    K = data.draw(st.integers(0, rows * block))

    def rules(c):
        first = scheduler.schedule(c, sps, active=active).lengths
        return {"first_drop": first,
                "first_drop+fill": scheduler.fill_to_bucket(c, first, BUCKETS, active=active),
                "top_k+fill": scheduler.fill_to_bucket(c, scheduler.top_k_lengths(c, jnp.int32(K), active=active),
                                                       BUCKETS, active=active)}

    for name, (x, y) in {n: (rules(conf)[n], rules(other)[n]) for n in rules(conf)}.items():
        assert (int(x[r]) >= k) == (int(y[r]) >= k), name


def test_argmax_admission_looks_at_its_own_draft():
    """The property above can fail: spec appendix A, where the argmax verifies x1 only when c2 is high."""
    sps = np.array([1.0, 1.0, 0.5, 0.45], np.float32)
    high = scheduler.schedule(np.array([[0.8, 0.9]], np.float32), sps, stop="argmax").lengths
    low = scheduler.schedule(np.array([[0.8, 0.0]], np.float32), sps, stop="argmax").lengths
    assert int(high[0]) >= 1 and int(low[0]) == 0


def test_top_k_lengths_staged_large():
    rng = np.random.default_rng(3)
    conf = make_conf(rng, 128, 16, "uniform")
    a = reference.survival(conf)
    order = sorted([(r, j) for r in range(128) for j in range(16)], key=lambda rj: -float(a[rj]))
    for k in [0, 1, 63, 64, 65, 300, 1500, 5000]:
        want = np.zeros(128, int)
        for r, j in order[:k]:
            want[r] = j + 1
        np.testing.assert_array_equal(scheduler.top_k_lengths(conf, jnp.int32(k)), want)


# ----------------------------------------------------------------------------- first drop vs argmax
def test_argmax_equals_first_drop_when_step_time_convex_nondecreasing():
    rng = np.random.default_rng(11)
    for i in range(60):
        rows, block = [(3, 4), (8, 7), (16, 16)][i % 3]
        conf = make_conf(rng, rows, block, CONF_KINDS[i % 3])
        b = np.arange(400, dtype=np.float64)
        t = rng.uniform(0.01, 0.1) + rng.uniform(0, 1e-3) * b + rng.uniform(0, 1e-5) * b**2
        sps = (1 / t).astype(np.float32)
        f = scheduler.schedule(conf, sps)
        m = scheduler.schedule(conf, sps, stop="argmax")
        if reference.algorithm1(conf, sps)[-1] >= TIE:
            np.testing.assert_array_equal(f.lengths, m.lengths)


def test_argmax_differs_from_first_drop_on_jagged_table():
    # One request, sure drafts; table with a dip at B=2 then a better point at B=4.
    conf = np.ones((1, 4), np.float32)
    sps = np.array([1.0, 1.0, 0.4, 0.4, 0.9, 0.1], np.float32)
    f = scheduler.schedule(conf, sps)
    m = scheduler.schedule(conf, sps, stop="argmax")
    assert int(f.lengths[0]) == 0  # Theta_1 = 2 * 0.4 < 1
    assert int(m.lengths[0]) == 3  # Theta_3 = 4 * 0.9 = 3.6 is the best point


def test_ties_admit_shorter_prefix_first():
    conf = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], np.float32)
    sps = np.full(5, 1.0, np.float32)  # room for 2 drafts beyond the 2 anchors
    s = scheduler.schedule(conf, sps)
    np.testing.assert_array_equal(s.lengths, [2, 0])  # row-major order among equal survival


# ----------------------------------------------------------------------------- composability
def test_inside_scan_and_while_loop_and_vmap():
    rng = np.random.default_rng(2)
    conf = np.stack([make_conf(rng, 8, 7, "high") for _ in range(5)])
    sps = make_sps(rng, 64, "smooth")
    want = np.stack([scheduler.schedule(c, sps).lengths for c in conf])

    def body(carry, c):
        return carry, scheduler.schedule(c, sps).lengths

    _, scanned = jax.jit(lambda cs: lax.scan(body, 0, cs))(conf)
    np.testing.assert_array_equal(scanned, want)

    def cond(state):
        return state[0] < 5

    def step(state):
        i, out = state
        return i + 1, out.at[i].set(scheduler.schedule(jnp.asarray(conf)[i], sps).lengths)

    _, looped = jax.jit(lambda: lax.while_loop(cond, step, (0, jnp.zeros((5, 8), jnp.int32))))()
    np.testing.assert_array_equal(looped, want)
    np.testing.assert_array_equal(jax.vmap(lambda c: scheduler.schedule(c, sps).lengths)(conf), want)


def test_no_recompilation_for_new_values():
    rng = np.random.default_rng(4)
    conf = make_conf(rng, 32, 7, "uniform")
    sps = make_sps(rng, 128, "smooth")
    active = np.ones(32, bool)
    for f in (
        functools.partial(scheduler.schedule, stop="first_drop"),
        functools.partial(scheduler.schedule, stop="argmax"),
        scheduler.capacity,
    ):
        jax.block_until_ready(f(conf, sps, active=active))
        with count_compilations() as n:
            for _ in range(3):
                jax.block_until_ready(
                    f(make_conf(rng, 32, 7, "high"), make_sps(rng, 128, "noisy"), active=rng.uniform(size=32) < 0.5)
                )
        assert n() == 0
    jax.block_until_ready(scheduler.top_k_lengths(conf, jnp.int32(3), active=active))
    with count_compilations() as n:
        jax.block_until_ready(scheduler.top_k_lengths(conf * 0.5, jnp.int32(17), active=~active))
    assert n() == 0


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "conf,sps,active,match",
    [
        (np.ones(3, np.float32), np.ones(8, np.float32), None, "2-D"),
        (np.full((2, 2), np.nan, np.float32), np.ones(8, np.float32), None, "NaN"),
        (np.full((2, 2), 1.5, np.float32), np.ones(8, np.float32), None, r"\[0, 1\]"),
        (np.full((2, 2), -0.1, np.float32), np.ones(8, np.float32), None, r"\[0, 1\]"),
        (np.ones((2, 2), np.float32), np.array([1.0, 0.0, 1.0], np.float32), None, "positive"),
        (np.ones((2, 2), np.float32), np.array([1.0, np.inf, 1.0], np.float32), None, "finite"),
        (np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), None, "1-D"),
        (np.ones((4, 2), np.float32), np.ones(4, np.float32), None, "too short for 4 active"),
        (np.ones((4, 2), np.float32), np.ones(8, np.float32), np.ones(3, bool), "active"),
        (np.ones((4, 2), np.int32), np.ones(8, np.float32), None, "float"),
    ],
)
def test_checked_entry_point_rejects_bad_input(conf, sps, active, match):
    with pytest.raises(ValueError, match=match):
        scheduler.schedule_checked(conf, sps, active=active)


def test_checked_entry_point_accepts_short_table_when_rows_inactive():
    conf = np.ones((4, 2), np.float32)
    active = np.array([True, False, False, False])
    s = scheduler.schedule_checked(conf, np.ones(3, np.float32), active=active)
    assert int(s.batch_tokens) == 2


def test_bad_stop_rule():
    with pytest.raises(ValueError, match="stop"):
        scheduler.schedule_checked(np.ones((1, 1), np.float32), np.ones(3, np.float32), stop="max")


def test_gain_below_float_resolution_still_admits():
    """Found by hypothesis: a survival of 1.4e-31 on a flat table raises Theta by 1.4e-31. Both the jitted
    scheduler and the plain loop admit it, as exact arithmetic says (the loop once compared the sums, where
    the gain is absorbed, and stopped)."""
    conf = np.zeros((4, 7), np.float32)
    conf[1, 0] = 1.3648326e-31
    sps = np.ones(6, np.float32)
    active = np.array([False, True, False, False])
    got = scheduler.schedule(jnp.asarray(conf), jnp.asarray(sps), active=jnp.asarray(active))
    np.testing.assert_array_equal(np.asarray(got.lengths), [0, 1, 0, 0])
    lengths, b, _, _, gap = scheduler.algorithm1_loop(conf, sps, active)
    np.testing.assert_array_equal(lengths, [0, 1, 0, 0])
    assert b == 2 and gap >= TIE


def test_jitted_entry_points_name_bad_shapes():
    """The jitted entry points check shapes when they trace (free under jit), naming the argument."""
    conf, sps = jnp.full((2, 3), 0.5), jnp.ones(8)
    with pytest.raises(ValueError, match=r"active must have shape \[R\] = \[2\]"):
        scheduler.schedule(conf, sps, active=jnp.ones(3, bool))
    with pytest.raises(ValueError, match=r"active must have shape \[R\] = \[2\]"):
        scheduler.top_k_lengths(conf, jnp.int32(2), active=jnp.ones(1, bool))
    with pytest.raises(ValueError, match=r"stale_confidences must have shape \[R, G\] with R, G >= 1"):
        scheduler.capacity(jnp.zeros((2, 0)), sps)
    with pytest.raises(ValueError, match=r"confidences: expected an array \[R, G\], got list"):
        scheduler.schedule([[0.5, 0.5]], sps)
    with pytest.raises(ValueError, match=r"sps: expected a 1-D table \[N\]"):
        scheduler.sps_lookup(jnp.ones((2, 4)), jnp.int32(1))
    s = scheduler.schedule(conf, sps, active=jnp.array([True, False]))
    assert int(s.batch_tokens) == 1 + int(s.lengths.sum())


def test_survival_probs_checks_its_input_like_the_scheduler():
    conf = jnp.full((3, 2), 0.5)
    with pytest.raises(ValueError, match=r"active must have shape \[R\] = \[3\]"):
        scheduler.survival_probs(conf, active=jnp.array([True]))
    with pytest.raises(ValueError, match="active must be bool"):
        scheduler.survival_probs(conf, active=jnp.array([2, 0, 1]))
    with pytest.raises(ValueError, match=r"must have shape \[R, G\]"):
        scheduler.survival_probs(jnp.full((3,), 0.5))
    with pytest.raises(ValueError, match="active must be bool"):
        scheduler.schedule(conf, jnp.ones(8), active=jnp.array([1, 1, 0]))
