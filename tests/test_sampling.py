"""Per-request sampling in the engine: greedy and sampled requests in one batch, each exact for its own settings
(temperature, top-p, seed, stop token ids), and cancelling requests between rounds."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import engine as eng
from dspark_jax import verify
from dspark_jax.decoding import plain_generate
from tests.test_engine import make_drafter, make_model, prompts

SPS = np.linspace(10.0, 1.0, 48).astype(np.float32)


def numpy_top_p(p, top_p):
    """Reference nucleus: most likely first (lower id on ties), keep while the mass before is below top_p."""
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep, mass = np.zeros(len(p), bool), 0.0
    for i in order:
        if mass >= top_p:
            break
        keep[i] = True
        mass += p[i]
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.8, 0.999, 1.0])
def test_top_p_filter_matches_a_reference(top_p):
    rng = np.random.default_rng(int(top_p * 1000))
    p = rng.dirichlet(np.full(17, 0.5), size=3).astype(np.float32)
    p[0, 3] = p[0, 5] = p[0].max()  # a tie: the lower id ranks first
    p /= p.sum(-1, keepdims=True)
    got = np.asarray(verify.top_p_filter(jnp.asarray(p), jnp.full(3, top_p, jnp.float32)))
    want = p if top_p >= 1 else np.stack([numpy_top_p(row.astype(np.float64), top_p) for row in p])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_greedy_rows_exact_beside_sampled_rows(model, drafter):
    """Greedy and sampled requests share rounds: the greedy ones equal plain greedy decoding token for token;
    a seeded sampled request gives the same tokens alone and in a full batch (fixed K: the same drafts)."""
    policy = "fixed:3"
    ps = prompts(4, seed=4)
    ref, _ = plain_generate(model, ps, 10, 0.0, num_slots=2, stop_ids=[], capacity=64)
    e = eng.Engine(model, drafter, policy, eng.EngineConfig(num_slots=2, capacity=64), sps=SPS, stop_ids=[])
    hot = eng.SamplingParams(temperature=1.3, top_p=0.9)
    ids = [e.submit(p, 10, None if i % 2 == 0 else hot) for i, p in enumerate(ps)]
    seeded = eng.SamplingParams(temperature=0.9, seed=7)
    lone_in_batch = e.submit(ps[1], 10, seeded)
    while not e.idle():
        e.step()
    for i, rid in enumerate(ids):
        out = e.requests[rid].output_ids
        if i % 2 == 0:
            assert out == ref[i].output_ids, i
        else:
            assert len(out) == 10
    assert any(r.active > 1 for r in e.rounds)
    alone = eng.Engine(model, drafter, policy, eng.EngineConfig(num_slots=2, capacity=64), stop_ids=[])
    rid = alone.submit(ps[1], 10, seeded)
    alone.run([], 1)
    assert alone.requests[rid].output_ids == e.requests[lone_in_batch].output_ids


def exact_law(model, prompt, m, vocab, temperature, top_p):
    """Exact law of the first m tokens sampled from top_p(softmax(logits / T)), by enumeration."""
    law = np.zeros((vocab,) * m)
    step = {}
    for n in range(m):
        for prefix in itertools.product(range(vocab), repeat=n):
            logits = np.asarray(model.score(list(prompt) + list(prefix)), np.float64)[-1] / temperature
            p = np.exp(logits - logits.max())
            step[prefix] = numpy_top_p(p / p.sum(), top_p)
    for z in itertools.product(range(vocab), repeat=m):
        law[z] = np.prod([step[z[:i]][z[i]] for i in range(m)])
    return law


def test_sampled_rows_follow_their_own_law_beside_greedy_rows():
    """On a 4-token vocabulary: requests at temperature 15 (this tiny model's logits span ~30) with top-p 0.8
    (which cuts tokens the drafter can still propose), mixed with greedy requests in the same rounds, follow
    top_p(softmax(logits / 15)) exactly (chi-square at p = 0.001); the greedy ones all give the argmax path."""
    model = make_model(vocab=4, scale=0.15, seed=1)
    d = make_drafter(model, seed=2, block=3)
    prompt, m, n_req = [1, 2, 3, 1], 3, 600  # m = 3: two drafts fit the budget after the first token
    law = exact_law(model, prompt, m, 4, 15.0, 0.8)
    assert (law == 0).any() and (law > 0.02).sum() >= 6  # the nucleus removes some outcomes, keeps several
    e = eng.Engine(model, d, "fixed:2", eng.EngineConfig(num_slots=8, capacity=32, seed=5), stop_ids=[])
    sampled = eng.SamplingParams(temperature=15.0, top_p=0.8)
    ids = [e.submit(prompt, m, sampled if i % 6 else None) for i in range(n_req + n_req // 5 + 1)]
    while not e.idle():
        e.step()
    outs = [e.requests[i].output_ids for k, i in enumerate(ids) if k % 6]
    greedy = {tuple(e.requests[i].output_ids) for k, i in enumerate(ids) if k % 6 == 0}
    ref, _ = plain_generate(model, [prompt], m, 0.0, num_slots=1, stop_ids=[], capacity=32)
    assert greedy == {tuple(ref[0].output_ids)}
    counts = np.zeros_like(law)
    for o in outs:
        counts[tuple(o)] += 1
    n = len(outs)
    assert counts[law == 0].sum() == 0
    expected = law * n
    big = expected >= 5
    chi2 = (((counts - expected) ** 2)[big] / expected[big]).sum()
    small_obs, small_exp = counts[~big & (law > 0)].sum(), expected[~big & (law > 0)].sum()
    if small_exp > 0:
        chi2 += (small_obs - small_exp) ** 2 / small_exp
    dof = int(big.sum()) + (small_exp > 0) - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit, dof)
    assert e.summary()["drafts_per_request"] > 0


def test_stop_token_ids_and_cancel(model, drafter):
    """A request's own stop id ends it at its first occurrence (kept as the last token); cancelling a queued
    and an active request frees the slot for the next one, and everyone else's output is unchanged."""
    ps = prompts(5, seed=8)
    ref, _ = plain_generate(model, ps, 12, 0.0, num_slots=2, stop_ids=[], capacity=64)
    stop = ref[0].output_ids[4]
    e = eng.Engine(model, drafter, "fixed:3", eng.EngineConfig(num_slots=2, capacity=64), stop_ids=[])
    a = e.submit(ps[0], 12, eng.SamplingParams(stop_token_ids=(stop,)))
    b, c, d, f = (e.submit(p, 12) for p in ps[1:])
    assert e.cancel(c) and e.requests[c].cancelled  # still queued
    e.step()
    e.step()
    assert e.cancel(b)  # active: its slot goes to the next request
    assert not e.cancel(b)
    with pytest.raises(ValueError, match="no request 99"):
        e.cancel(99)
    while not e.idle():
        e.step()
    first = ref[0].output_ids.index(stop) + 1
    assert e.requests[a].output_ids == ref[0].output_ids[:first] and e.requests[a].finished_by_stop
    assert e.requests[c].output_ids == []
    assert 1 <= len(e.requests[b].output_ids) < 12 and e.requests[b].output_ids == ref[1].output_ids[
        :len(e.requests[b].output_ids)]
    assert [e.requests[i].output_ids for i in (d, f)] == [ref[3].output_ids, ref[4].output_ids]
    assert sorted(e.finished_ids) == sorted([a, b, c, d, f])


def test_ignore_eos_runs_to_the_budget(model, drafter):
    """With ignore_eos the engine's stop ids do not end a request, in the first token or in any round, while its
    own stop ids still do; the output is plain decoding's without stop ids. Its neighbours still stop."""
    ps = prompts(3, seed=9)
    ref, _ = plain_generate(model, ps, 14, 0.0, num_slots=2, stop_ids=[], capacity=64)
    first = ref[0].output_ids[0]  # ends at admission unless ignored
    later = ref[1].output_ids[5]  # ends a round's accepted drafts unless ignored
    own = ref[2].output_ids[6]
    e = eng.Engine(model, drafter, "fixed:3", eng.EngineConfig(num_slots=3, capacity=64), stop_ids=[first, later])
    a = e.submit(ps[0], 14, eng.SamplingParams(ignore_eos=True))
    b = e.submit(ps[1], 14, eng.SamplingParams(ignore_eos=True))
    c = e.submit(ps[2], 14, eng.SamplingParams(ignore_eos=True, stop_token_ids=(own,)))
    d = e.submit(ps[1], 14)  # the same prompt without ignore_eos stops at the engine's stop id
    while not e.idle():
        e.step()
    assert e.requests[a].output_ids == ref[0].output_ids and not e.requests[a].finished_by_stop
    assert e.requests[b].output_ids == ref[1].output_ids and not e.requests[b].finished_by_stop
    cut = ref[2].output_ids.index(own) + 1
    assert e.requests[c].output_ids == ref[2].output_ids[:cut] and e.requests[c].finished_by_stop
    stop_at = min(ref[1].output_ids.index(t) for t in (first, later) if t in ref[1].output_ids) + 1
    assert e.requests[d].output_ids == ref[1].output_ids[:stop_at] and e.requests[d].finished_by_stop
    assert e.summary()["drafts_per_request"] > 0


def test_bad_sampling_is_rejected():
    for kw, msg in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                    ({"seed": -3}, "seed"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
                    ({"temperature": float("nan")}, "temperature"), ({"ignore_eos": "yes"}, "ignore_eos")):
        with pytest.raises(ValueError, match=msg):
            eng.SamplingParams(**kw)


def test_temperatures_below_the_greedy_bar_decode_greedily(model, drafter):
    """A temperature too small to divide logits by in float32 (1e-40 overflows them, 1e-46 rounds to 0) is
    greedy, per request and as the engine's default, and the plain decoder agrees; NaN is refused."""
    for t in (1e-46, 1e-40, 1e-6):
        assert eng.SamplingParams(temperature=t).temperature == 0.0
        assert eng.EngineConfig(temperature=t).temperature == 0.0
    assert eng.SamplingParams(temperature=1e-3).temperature == 1e-3
    for bad in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="temperature: expected a finite number"):
            eng.EngineConfig(temperature=bad)
    ps = prompts(3, seed=5)
    ref, _ = plain_generate(model, ps, 8, 0.0, num_slots=3, stop_ids=[], capacity=64)
    tiny, _ = plain_generate(model, ps, 8, 1e-40, num_slots=3, stop_ids=[], capacity=64)
    assert [r.output_ids for r in tiny] == [r.output_ids for r in ref]
    for policy in ("none", "fixed:3"):
        e = eng.Engine(model, drafter, policy, eng.EngineConfig(num_slots=3, capacity=64, temperature=1e-45),
                       sps=SPS, stop_ids=[])
        hot = eng.SamplingParams(temperature=1.0, seed=3)  # shares the rounds
        ids = [e.submit(p, 8, eng.SamplingParams(temperature=t)) for p, t in zip(ps, (1e-40, None, 1e-7))]
        e.submit(ps[0], 8, hot)
        while not e.idle():
            e.step()
        assert [e.requests[i].output_ids for i in ids] == [r.output_ids for r in ref], policy


@pytest.mark.parametrize("n,block", [(37, 8), (300, 128), (64, 64)])
def test_blocked_categorical_draws_the_softmax_law(n, block):
    """The two-level Gumbel draw samples softmax(logits) exactly: empirical frequencies over 40 000 keys sit
    within 5 standard errors of every category's probability, and categories at -inf are never drawn (n not a
    multiple of the block pads with -inf)."""
    import jax

    from dspark_jax.sampling import categorical

    rng = np.random.default_rng(n)
    logits = rng.normal(size=n).astype(np.float32) * 2.0
    logits[rng.choice(n, n // 5, replace=False)] = -np.inf
    logits[rng.integers(n)] = 4.0  # a peaked row: one block holds much of the mass
    p = np.exp(logits - logits[np.isfinite(logits)].max())
    p /= p.sum()
    draws = 40_000
    keys = jax.random.split(jax.random.key(n), draws)
    got = np.asarray(categorical(keys, jnp.broadcast_to(jnp.asarray(logits), (draws, n)), block=block))
    freq = np.bincount(got, minlength=n) / draws
    assert freq.shape == (n,) and freq[p == 0].sum() == 0
    se = np.sqrt(p * (1 - p) / draws) + 1e-12
    assert np.max(np.abs(freq - p) / se) < 5.0, np.max(np.abs(freq - p) / se)


def test_blocked_categorical_takes_raw_keys_and_rows_apart():
    """A row's draw depends on its own key only; raw uint32 keys work as new-style ones do."""
    import jax

    from dspark_jax.sampling import categorical

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 1000)), jnp.float32)
    keys = jax.random.split(jax.random.key(3), 4)
    whole = np.asarray(categorical(keys, logits))
    alone = [int(categorical(keys[i:i + 1], logits[i:i + 1])[0]) for i in range(4)]
    assert whole.tolist() == alone
    raw = jax.random.split(jax.random.PRNGKey(3), 4)
    assert np.asarray(categorical(raw, logits)).shape == (4,)


def test_bench_sampling_rows():
    from profiling import bench_sampling

    rows = bench_sampling.main(["--quick", "--vocab", "300", "--draft-vocab", "40"])
    assert [(r["rows"], r["categories"]) for r in rows] == [(n, v) for v in (300, 40) for n in (1, 16, 64)]
    assert all(r["one_level_ms"] > 0 and r["blocked_ms"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        bench_sampling.main(["--vocab", "0"])
