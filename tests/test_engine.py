"""The engine: lossless greedy and sampled decoding for every policy, continuous batching, no recompiles."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import engine as eng
from dspark_jax.engine import programs
from dspark_jax import gate, scheduler, verify
from dspark_jax.decoding import plain_generate
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights
from tests.helpers import assert_follows_law, count_compilations, synthetic_cost_table

POLICIES = ["none", "fixed:3", "fixed:0", "threshold:0.3", "dspark", "dspark-async"]
SPS = np.linspace(10.0, 1.0, 48).astype(np.float32)  # falls with the batch: the scheduler has a real trade-off


def make_model(vocab=64, scale=0.3, seed=0):
    cfg = LlamaConfig.tiny(vocab_size=vocab)
    return LlamaModel(cfg, init_random_weights(cfg, jax.random.key(seed), scale=scale), None)


def make_drafter(model, head="markov", confidence=True, seed=0, block=4):
    cfg = dr.DrafterConfig.for_target(model.cfg, n_layers=1, ffn_dim=32, rank=8, block=block, head=head,
                                      confidence=confidence)
    d = dr.Drafter(cfg, rngs=nnx.Rngs(seed))
    if head != "none":
        d.w2.kernel[...] = 0.5 * jax.random.normal(jax.random.key(seed + 3), d.w2.kernel[...].shape)
    return d


def prompts(n, seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=rng.integers(2, 18)).tolist() for _ in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_plain_decoding_with_joins_and_leaves(model, drafter, policy):
    ps = prompts(9)
    budgets = [3, 12, 7, 1, 15, 9, 4, 12, 2]  # requests leave at different rounds; later ones join freed slots
    stop = [5]
    ref = [plain_generate(model, [p], b, 0.0, num_slots=1, stop_ids=stop, capacity=64)[0][0].output_ids
           for p, b in zip(ps, budgets)]
    e = eng.Engine(model, drafter, policy, eng.EngineConfig(num_slots=3, capacity=64), sps=SPS, stop_ids=stop)
    ids = [e.submit(p, b) for p, b in zip(ps, budgets)]
    while not e.idle():
        e.step()
    for i, r in zip(ids, ref):
        assert e.requests[i].output_ids == r
    assert max(r.active for r in e.rounds) == 3 and min(r.active for r in e.rounds) < 3


def test_dflash_drafter_without_confidence_head_is_lossless(model):
    d = make_drafter(model, head="none", confidence=False)
    ps = prompts(4, seed=3)
    ref, _ = plain_generate(model, ps, 10, 0.0, num_slots=2, stop_ids=[], capacity=64)
    for policy in ("fixed:4", "dspark"):
        e = eng.Engine(model, d, policy, eng.EngineConfig(num_slots=2, capacity=64), sps=SPS, stop_ids=[])
        assert [c.output_ids for c in e.run(ps, 10)] == [r.output_ids for r in ref]


def exact_joint(model, prompt, m, vocab):
    """Exact law of the first m generated tokens at temperature 1, by enumeration."""
    law = np.zeros((vocab,) * m)
    probs = {}
    for n in range(m):
        for prefix in itertools.product(range(vocab), repeat=n):
            logits = np.asarray(model.score(list(prompt) + list(prefix)))[-1]
            p = np.exp(logits - logits.max())
            probs[prefix] = p / p.sum()
    for z in itertools.product(range(vocab), repeat=m):
        law[z] = np.prod([probs[z[:i]][z[i]] for i in range(m)])
    return law


@pytest.fixture(scope="module")
def small_vocab():
    m = make_model(vocab=4, scale=0.15, seed=1)
    return m, make_drafter(m, seed=2, block=3), [1, 2, 3, 1]


@pytest.mark.parametrize("policy", ["none", "fixed:2", "threshold:0.3", "dspark", "dspark-async"])
def test_sampled_output_follows_the_target(small_vocab, policy):
    model, d, prompt = small_vocab
    m, n_req = 3, 1500
    law = exact_joint(model, prompt, m, 4)
    e = eng.Engine(model, d, policy, eng.EngineConfig(num_slots=16, capacity=32, temperature=1.0, seed=11),
                   sps=np.linspace(10, 4, 64).astype(np.float32), stop_ids=[])
    out = e.run([prompt] * n_req, m)  # every request has its own random stream
    assert_follows_law([c.output_ids for c in out], law)
    if policy != "none":
        assert e.summary()["drafts_per_request"] > 0


def test_only_lossless_policies_are_offered():
    for text in ("argmax", "dspark-argmax", "fixed:-1", "threshold:2", "fixed:x", "greedy"):
        with pytest.raises(ValueError, match="expected one of"):
            eng.parse_policy(text)
    assert [str(eng.parse_policy(p)) for p in POLICIES] == POLICIES


def test_appendix_a_through_the_policy_layer():
    """Spec appendix A: an argmax over fresh confidences biases the output; the engine's policies do not."""
    sps = np.array([1.0, 1.0, 0.5, 0.45], np.float32)
    p_t, p_d = np.array([0.7, 0.3]), np.array([0.5, 0.5])

    def first_token_law(lengths_fn):
        law = 0.0
        for x1 in (0, 1):
            conf = jnp.array([[0.8, 0.9 if x1 == 0 else 0.0]])
            lengths = lengths_fn(conf)
            dp = jnp.array([[[0.5, 0.5], [0.6, 0.4]]])
            tp = jnp.array([[p_t, [0.5, 0.5], [0.5, 0.5]]])
            acc = float(verify.acceptance_probs(jnp.array([[x1, 0]]), dp, tp)[0, 0])
            nxt = np.asarray(verify.next_token_probs(dp, tp, jnp.array([0]), lengths))[0]
            verified = int(lengths[0]) >= 1
            law += p_d[x1] * ((acc * (x1 == 0) if verified else 0.0) + (1 - acc if verified else 1.0) * nxt[0])
        return law

    valid = jnp.array([True])
    hist = jnp.array([[0.8, 0.9]])
    for policy in ("dspark", "dspark-async", "threshold:0.85", "fixed:1"):
        pol = eng.parse_policy(policy)
        law = first_token_law(lambda c: eng.policy_lengths(pol, jnp.float32(pol.value), c, hist, jnp.asarray(sps),
                                                           valid, 2))
        np.testing.assert_allclose(law, 0.7, atol=1e-6)
    unsafe = first_token_law(lambda c: scheduler.schedule(c, jnp.asarray(sps), stop="argmax").lengths)
    np.testing.assert_allclose(unsafe, 0.85, atol=1e-6)


def test_no_recompilation_after_warm_up(model, drafter):
    e = eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64), sps=SPS, stop_ids=[5])
    e.warm_up(max_prompt_tokens=20)
    with count_compilations() as n:
        e.run(prompts(7, seed=5), 9)  # loads of 1..4 requests, varying scheduled tokens
    assert n() == 0
    assert len({r.active for r in e.rounds}) > 1 and len({r.padded_tokens for r in e.rounds}) > 1


def test_policy_numbers_share_compiled_programs(model, drafter):
    """fixed:K for every K (threshold:C for every C) runs the same programs: K and C are arrays, not static
    arguments, so a sweep compiles once."""
    ps = prompts(4, seed=11)
    ref, _ = plain_generate(model, ps, 8, 0.0, num_slots=2, stop_ids=[], capacity=64)
    for first, second in (("fixed:3", "fixed:1"), ("threshold:0.2", "threshold:0.9")):
        e = eng.Engine(model, drafter, first, eng.EngineConfig(num_slots=2, capacity=64), stop_ids=[])
        e.warm_up(max_prompt_tokens=20)
        other = eng.Engine(model, drafter, second, eng.EngineConfig(num_slots=2, capacity=64), stop_ids=[])
        with count_compilations() as n:
            other.warm_up(max_prompt_tokens=20)
            out = other.run(ps, 8)
        assert n() == 0, (first, second)
        assert [c.output_ids for c in out] == [r.output_ids for r in ref]
        if second == "fixed:1":
            assert max(int(r.scheduled.max()) for r in other.rounds) == 1


def test_stream_of_many_short_requests(model, drafter):
    e = eng.Engine(model, drafter, "dspark-async", eng.EngineConfig(num_slots=8, capacity=48), sps=SPS, stop_ids=[5])
    rng = np.random.default_rng(9)
    ps = prompts(200, seed=9)
    budgets = rng.integers(1, 6, size=200)
    ids = [e.submit(p, int(b)) for p, b in zip(ps, budgets)]
    assert len(set(ids)) == 200
    while not e.idle():
        e.step()
    for i, b in zip(ids, budgets):
        c = e.requests[i]
        assert 1 <= len(c.output_ids) <= b
        assert c.finished_by_stop == (c.output_ids[-1] == 5)
        assert c.finished_by_stop or len(c.output_ids) == b
        assert 5 not in c.output_ids[:-1]


def test_bad_input_is_rejected(model, drafter):
    with pytest.raises(ValueError, match="needs a drafter"):
        eng.Engine(model, None, "dspark", sps=SPS)
    e = eng.Engine(model, drafter, "fixed:2", eng.EngineConfig(num_slots=2, capacity=32), stop_ids=[])
    with pytest.raises(ValueError, match="capacity is 32"):
        e.submit(list(range(1, 30)), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        e.submit([1, 2], 0)
    with pytest.raises(ValueError, match="sts_temperatures"):
        eng.Engine(model, drafter, "fixed:2", sts_temperatures=[1.0, 2.0])


def test_cost_model_drives_the_schedule_without_recompiling(model, drafter):
    table = synthetic_cost_table()
    ps = prompts(6, seed=12)
    ref, _ = plain_generate(model, ps, 10, 0.0, num_slots=2, stop_ids=[5], capacity=64)
    e = eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64), sps=table, stop_ids=[5])
    assert e.cost is not None
    e.warm_up(max_prompt_tokens=20)
    with count_compilations() as n:
        out = e.run(ps, 10)
    assert n() == 0
    assert [c.output_ids for c in out] == [r.output_ids for r in ref]
    with pytest.raises(ValueError, match="window rule"):
        eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64, window_rule="pow2"),
                   sps=table)


def test_dspark_rounds_fill_the_padded_batch(model, drafter):
    """The dspark policies verify the next-ranked drafts in the room the padded batch leaves (free: the
    bucket is computed anyway), lossless with the fill on and off."""
    ps = prompts(4, seed=21)
    ref, _ = plain_generate(model, ps, 30, 0.0, num_slots=4, stop_ids=[], capacity=64)
    share = {}
    for fill in (True, False):
        for policy in ("dspark", "dspark-async"):  # the shapes of the other gate tests: programs shared
            cfg = eng.EngineConfig(num_slots=4, capacity=64, gate=gate.GateConfig(fill=fill, calibrate_times=False))
            e = eng.Engine(model, drafter, policy, cfg, sps=synthetic_cost_table(), stop_ids=[])
            assert [c.output_ids for c in e.run(ps, 30)] == [r.output_ids for r in ref], (policy, fill)
            # rounds with drafts and every request far from its limit (no cap shortened a row)
            spec = [r for r in e.rounds if r.scheduled.sum() > 0 and r.finished == 0]
            full = [r.batch_tokens == r.padded_tokens or np.all(r.scheduled == e.G) for r in spec]
            share[policy, fill] = np.mean(full) if spec else None
    for policy in ("dspark", "dspark-async"):
        assert share[policy, True] is not None and share[policy, True] >= 0.8, share


def test_busy_engine_skips_a_drafter_that_does_not_pay(model, drafter):
    """With a drafter that costs ten verification steps, dspark decodes plainly (and stays lossless); with
    probes it drafts exactly once after every `GateConfig.probe_every` skipped rounds, to refresh its estimates."""
    ps = prompts(3, seed=4)
    ref, _ = plain_generate(model, ps, 12, 0.0, num_slots=3, stop_ids=[], capacity=64)
    for draft_cost, probe in ((1.0, 1000), (1.0, 2), (0.0, 1000)):
        g = gate.GateConfig(probe_every=probe, probe_budget=float("inf"), calibrate_times=False)
        e = eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64, gate=g),
                       sps=synthetic_cost_table(draft_cost=draft_cost), stop_ids=[])
        assert [c.output_ids for c in e.run(ps, 12)] == [r.output_ids for r in ref]
        drafted = [r.drafted for r in e.rounds]
        if draft_cost == 0.0:
            assert any(drafted)
        elif probe == 1000:
            assert not any(drafted)
        else:
            assert drafted[:6] == [False, False, True, False, False, True], drafted


def test_gate_margin_asks_drafting_for_a_clear_gain(model, drafter):
    """The gate opens only when drafting promises ``1 + GateConfig.margin`` times plain decoding's throughput: a
    free drafter drafts with no margin and never with an impossible one (output lossless either way)."""
    ps = prompts(3, seed=4)
    ref, _ = plain_generate(model, ps, 12, 0.0, num_slots=3, stop_ids=[], capacity=64)
    for margin, drafts in ((0.0, True), (50.0, False)):
        g = gate.GateConfig(probe_every=1000, margin=margin, calibrate_times=False)
        e = eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64, gate=g),
                       sps=synthetic_cost_table(draft_cost=0.0), stop_ids=[])
        assert [c.output_ids for c in e.run(ps, 12)] == [r.output_ids for r in ref]
        assert any(r.drafted for r in e.rounds) == drafts, margin
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="^margin: expected a finite share >= 0"):
            eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64,
                                                                  gate=gate.GateConfig(margin=bad)),
                       sps=synthetic_cost_table())


def _spy(monkeypatch, name, log):
    """Record the keyword arguments of every call to the engine's jitted program ``name`` (`engine.programs`)
    in ``log``, with ``with_drafter``: whether the drafter was among its inputs."""
    real = getattr(programs, name)
    monkeypatch.setattr(programs, name, lambda *a, **k: log.append(
        {**k, "with_drafter": a[1].dstate is not None}) or real(*a, **k))


def test_closed_gate_skips_the_draft_program(model, drafter, monkeypatch):
    """Once a round finds the drafter will not pay for the same requests, the next rounds do not run the draft
    program at all (no dispatch, no host read) until someone joins; output stays that of plain decoding."""
    calls = []
    _spy(monkeypatch, "draft_and_schedule", calls)
    ps = prompts(5, seed=6)
    ref, _ = plain_generate(model, ps, 10, 0.0, num_slots=3, stop_ids=[], capacity=64)
    e = eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=3, capacity=64, gate=gate.GateConfig(
        probe_every=1000, calibrate_times=False)), sps=synthetic_cost_table(draft_cost=1.0), stop_ids=[])
    assert [c.output_ids for c in e.run(ps, 10)] == [r.output_ids for r in ref]
    admissions = sum(1 for i, r in enumerate(e.rounds) if i == 0 or r.finished)  # rounds after a slot freed
    assert 1 <= len(calls) <= admissions < len(e.rounds)
    assert not any(r.drafted for r in e.rounds)


def test_the_drafter_waits_for_requests_without_its_context(model, drafter):
    """Requests admitted where the drafter is off keep it waiting while they are active (their context is
    missing); once they finish, a request admitted at a light load drafts again."""
    ps = prompts(4, seed=13)
    ref, _ = plain_generate(model, ps, 10, 0.0, num_slots=3, stop_ids=[], capacity=64)
    e = eng.Engine(model, drafter, "dspark",
                   eng.EngineConfig(num_slots=3, capacity=64, gate=gate.GateConfig(calibrate_times=False)),
                   sps=synthetic_cost_table(draft_cost=0.0), stop_ids=[])  # a free drafter
    e.cutoff = gate.CutOff(off_rounds={3: 0})  # off at three requests (row bucket 3: capped at the slots)
    ids = [e.submit(ps[0], 6)]  # the shortest: it leaves first
    e.step()  # alone: it has the context
    ids += [e.submit(p, 10) for p in ps[1:3]]  # joining at a load of three: they have not
    e.rounds.clear()
    while not e.idle():
        e.step()
    assert e.admissions == {"context": 1, "no_context": 2}
    assert not any(r.drafted for r in e.rounds)  # nobody drafts while one of them is active
    e.rounds.clear()
    ids.append(e.submit(ps[3], 10))  # alone: the context again, and the gate decides
    while not e.idle():
        e.step()
    assert e.admissions == {"context": 2, "no_context": 2}
    assert any(r.drafted for r in e.rounds)
    assert [e.requests[i].output_ids for i in ids] == [ref[0].output_ids[:6]] + [r.output_ids for r in ref[1:]]


def test_the_drafter_is_switched_off_where_the_gate_stays_shut(model, drafter, monkeypatch):
    """GateConfig.off_after: a drafter that never pays (it costs ten verifications) keeps the gate's estimate
    below the bar; after that many request-rounds at a load the active requests drop their context and the
    rounds are plain decoding's own programs (no context write, no gate), requests joining at that load come
    without one; `warm_up` compiled those programs too. A free drafter opens the gate and is never switched
    off. Output lossless throughout."""
    ps = prompts(6, seed=6)
    ref, _ = plain_generate(model, ps, 10, 0.0, num_slots=3, stop_ids=[], capacity=64)
    for draft_cost in (1.0, 0.0):
        cfg = eng.EngineConfig(num_slots=3, capacity=64, gate=gate.GateConfig(
            probe_every=1000, calibrate_times=False, off_after=6, off_requests=3))
        e = eng.Engine(model, drafter, "dspark", cfg, sps=synthetic_cost_table(draft_cost=draft_cost), stop_ids=[])
        if draft_cost:
            e.warm_up(max_prompt_tokens=20)  # compiles plain decoding's programs too
        verifies, prefill_ctx = [], []
        _spy(monkeypatch, "verify_and_commit", verifies)
        _spy(monkeypatch, "write_chunk_context", prefill_ctx)
        with count_compilations() as compiled:
            assert [c.output_ids for c in e.run(ps, 10)] == [r.output_ids for r in ref]
        monkeypatch.undo()
        if draft_cost:
            assert compiled() == 0
            # 3 requests, 2 rounds below the bar (6 request-rounds): off from the third round (row bucket 3:
            # powers of two capped at the slot count)
            assert e.drafter_offs == [(1, 3)], e.drafter_offs
            assert all(k["drafting"] for k in verifies[:2]) and not any(k["drafting"] for k in verifies[2:])
            # from then on plain decoding's own verification: the drafter is not among its inputs
            assert all(k["with_drafter"] for k in verifies[:2]) and not any(k["with_drafter"] for k in verifies[2:])
            assert not any(r.drafted for r in e.rounds)
            assert e.admissions["no_context"] >= 1 and len(prefill_ctx) == e.admissions["context"] == 3
        else:
            assert e.drafter_offs == [] and e.admissions == {"context": 6, "no_context": 0}
            assert any(r.drafted for r in e.rounds)


def test_the_cut_off_waits_for_evidence_from_enough_requests(model, drafter):
    """GateConfig.off_requests: with 3 slots and 4 distinct requests asked for, the drafter that never pays is
    switched off only in a round with a request of the second wave (ids, not slots, are counted)."""
    ps = prompts(6, seed=6)
    ref, _ = plain_generate(model, ps, 10, 0.0, num_slots=3, stop_ids=[], capacity=64)
    cfg = eng.EngineConfig(num_slots=3, capacity=64, gate=gate.GateConfig(
        probe_every=1000, calibrate_times=False, off_after=6, off_requests=4))
    e = eng.Engine(model, drafter, "dspark", cfg, sps=synthetic_cost_table(draft_cost=1.0), stop_ids=[])
    assert [c.output_ids for c in e.run(ps, 10)] == [r.output_ids for r in ref]
    (at, bucket), = e.drafter_offs
    first_finish = next(i for i, r in enumerate(e.rounds) if r.finished)
    assert at > first_finish and bucket == 3, (e.drafter_offs, first_finish)


def test_a_switched_off_drafter_is_tried_again(model, drafter):
    """After GateConfig.off_retry rounds with the drafter off at a load, requests joining there get the context
    again and the gate looks afresh (and, the drafter never paying, switches it off again)."""
    ps = prompts(6, seed=8)
    ref, _ = plain_generate(model, ps, 6, 0.0, num_slots=1, stop_ids=[], capacity=64)
    cfg = eng.EngineConfig(num_slots=1, capacity=64, gate=gate.GateConfig(
        probe_every=1000, calibrate_times=False, off_after=3, off_requests=1, off_retry=6))
    e = eng.Engine(model, drafter, "dspark", cfg, sps=synthetic_cost_table(draft_cost=1.0), stop_ids=[])
    assert [c.output_ids for c in e.run(ps, 6)] == [r.output_ids for r in ref]
    # one request at a time, 5 rounds each: off after 3 rounds, on again for a request joining 6 rounds later
    assert len(e.drafter_offs) >= 2 and all(R == 1 for _, R in e.drafter_offs), e.drafter_offs
    assert e.admissions["context"] >= 2 and e.admissions["no_context"] >= 1, e.admissions
    for key, bad in (("off_after", 0), ("off_after", 2.5), ("off_retry", 0)):
        with pytest.raises(ValueError, match=f"^{key}: expected"):
            eng.Engine(model, drafter, "dspark", eng.EngineConfig(gate=gate.GateConfig(**{key: bad})),
                       sps=synthetic_cost_table())


def test_measured_round_times_correct_the_cost_model(model, drafter):
    """The gate reads the cost model's round times times what the engine measured: a drafter the table
    charges too much for is used once the engine has seen that drafting rounds are cheaper than predicted."""
    ps = prompts(3, seed=4)
    ref, _ = plain_generate(model, ps, 12, 0.0, num_slots=3, stop_ids=[], capacity=64)
    table = synthetic_cost_table(draft_cost=0.02)
    frozen = eng.EngineConfig(num_slots=4, capacity=64, gate=gate.GateConfig(probe_every=1000, calibrate_times=False))
    base = eng.Engine(model, drafter, "dspark", frozen, sps=table, stop_ids=[])
    assert [c.output_ids for c in base.run(ps, 12)] == [r.output_ids for r in ref]
    assert not any(r.drafted for r in base.rounds) and base.time_scale == (1.0, 1.0)
    e = eng.Engine(model, drafter, "dspark", frozen, sps=table, stop_ids=[])
    learned, cfg = gate.RoundTimes(), gate.GateConfig()
    for _ in range(100):  # drafting rounds measured at a fifth of the table's prediction, plain ones as predicted
        learned = gate.observe_round(learned, cfg, True, 0.2, 1.0)
        learned = gate.observe_round(learned, cfg, False, 1.0, 1.0)
    e.round_times = learned  # GateConfig.calibrate_times off: the engine keeps it as it is
    d_scale, p_scale = e.time_scale
    assert d_scale == pytest.approx(0.2, rel=0.05) and p_scale == pytest.approx(1.0, rel=0.05)
    assert [c.output_ids for c in e.run(ps, 12)] == [r.output_ids for r in ref]
    assert any(r.drafted for r in e.rounds) and e.round_times == learned
    e.reset_time_scale()
    assert e.time_scale == (1.0, 1.0)


def test_measured_round_times_close_the_gate_on_a_table_that_prices_drafting_low(model, drafter):
    """The other direction, the one the default (GateConfig.calibrate_times on) guards against: a table that prices a
    drafting round at a plain one's cost makes the gate draft; once the engine has measured drafting rounds
    at four times their price, it stops (output lossless either way)."""
    ps = prompts(3, seed=4)
    ref, _ = plain_generate(model, ps, 12, 0.0, num_slots=3, stop_ids=[], capacity=64)
    table = synthetic_cost_table(draft_cost=0.0)
    assert eng.EngineConfig().gate.calibrate_times
    frozen = eng.EngineConfig(num_slots=4, capacity=64, gate=gate.GateConfig(probe_every=1000, calibrate_times=False))
    base = eng.Engine(model, drafter, "dspark", frozen, sps=table, stop_ids=[])
    assert [c.output_ids for c in base.run(ps, 12)] == [r.output_ids for r in ref]
    assert any(r.drafted for r in base.rounds)
    e = eng.Engine(model, drafter, "dspark", frozen, sps=table, stop_ids=[])  # round_times frozen at what is set
    learned, cfg = gate.RoundTimes(), gate.GateConfig()
    for _ in range(100):
        learned = gate.observe_round(learned, cfg, True, 4.0, 1.0)
        learned = gate.observe_round(learned, cfg, False, 1.0, 1.0)
    e.round_times = learned
    assert e.time_scale[0] == pytest.approx(4.0, rel=0.05)
    assert [c.output_ids for c in e.run(ps, 12)] == [r.output_ids for r in ref]
    assert not any(r.drafted for r in e.rounds)


def test_expensive_probes_come_less_often(model, drafter):
    """Probes are spaced so that their extra cost stays under GateConfig.probe_budget of the time: with a drafter
    that costs far more than a plain round the engine waits longer than GateConfig.probe_every between probes."""
    ps = prompts(3, seed=4)
    ref, _ = plain_generate(model, ps, 30, 0.0, num_slots=3, stop_ids=[], capacity=64)
    table = synthetic_cost_table(draft_cost=0.05)  # a probe round costs several plain rounds here
    gaps = {}
    for budget in (float("inf"), 2.0):
        g = gate.GateConfig(probe_every=2, probe_budget=budget, calibrate_times=False)
        e = eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64, gate=g),
                       sps=table, stop_ids=[])
        assert [c.output_ids for c in e.run(ps, 30)] == [r.output_ids for r in ref]
        drafted = [i for i, r in enumerate(e.rounds) if r.drafted]
        assert len(drafted) >= 2
        gaps[budget] = min(np.diff(drafted))
    assert gaps[float("inf")] == 3 and gaps[2.0] > 3
    with pytest.raises(ValueError, match="^probe_budget: expected"):
        eng.Engine(model, drafter, "dspark", eng.EngineConfig(gate=gate.GateConfig(probe_budget=0.0)), sps=table)


def test_gate_acceptance_sums_follow_the_drafted_rounds(model, drafter):
    """The gate's (predicted, accepted) sums follow the engine's drafted rounds: the accepted sum decays by
    accept_decay and adds each round that verified drafts (the arithmetic itself: tests/test_gate.py)."""
    e = eng.Engine(model, drafter, "dspark", eng.EngineConfig(num_slots=4, capacity=64, gate=gate.GateConfig(
        probe_every=1000, calibrate_times=False)), sps=synthetic_cost_table(draft_cost=0.0), stop_ids=[])
    cfg = e.gate_cfg
    e.run(prompts(2, seed=8), 12)
    predicted, accepted = np.asarray(e.state.gate.accept_seen)
    assert any(r.drafted for r in e.rounds) and predicted != cfg.accept_prior
    want = cfg.accept_prior  # the accepted sum: decayed, plus each round that verified drafts
    for r in e.rounds:
        if r.drafted and r.scheduled.sum() > 0:
            want = cfg.accept_decay * want + int(r.accepted.sum())
    assert accepted == pytest.approx(want, rel=1e-5)


def test_each_request_uses_the_sts_set_fitted_nearest_its_temperature(model, drafter):
    """Greedy and sampled requests in one batch: each row's confidences are its own set's calibration, the
    set's logit offsets included."""
    from dspark_jax.calibration import STSSets
    from dspark_jax.engine import SamplingParams

    sets = STSSets(np.array([0.0, 1.0]), np.array([[1.0, 2.0, 0.5, 3.0], [4.0, 0.25, 1.5, 8.0]]),
                   np.array([[-1.0, 0.5, 0.0, 0.25], [0.0, -0.5, 1.0, 0.0]]))
    e = eng.Engine(model, drafter, "fixed:4", eng.EngineConfig(num_slots=3, capacity=64), sts_temperatures=sets,
                   stop_ids=[])
    e.record_confidences = e.record_tokens = True
    temps = {e.submit(p, 6, sampling=SamplingParams(temperature=t)): t
             for p, t in zip(prompts(3, seed=21), [0.0, 0.8, 0.2])}
    seen = 0
    while not e.idle():
        st = e.step().stats
        if st is None or st.confidence_logits is None or not st.drafted:
            continue
        for row, rid in enumerate(st.requests):
            t = temps[int(rid)]
            want = 1 / (1 + np.exp(-(st.confidence_logits[row] / sets.for_temperature(t)
                                     + sets.biases_for_temperature(t))))
            np.testing.assert_allclose(st.confidences[row], want, rtol=1e-5, atol=1e-7)
            seen += 1
    assert seen >= 3
    assert sets.for_temperature(0.8).tolist() == [4.0, 0.25, 1.5, 8.0]
    assert sets.for_temperature(0.2).tolist() == [1.0, 2.0, 0.5, 3.0]


def test_engine_checks_its_table_against_its_hardware_mesh_and_size(model, drafter):
    """An engine built directly (not only through build_engine) refuses a table of another mesh, and warns by
    name where the table was measured on another backend, device kind or dtype, or stops short of its largest
    round (slots x (G + 1) tokens)."""
    from dspark_jax.sps import SPSMetadata, SPSTable

    def table(batch, **meta):
        return SPSTable.from_arrays(batch, np.linspace(10.0, 4.0, len(batch)), metadata=SPSMetadata(**meta))

    cfg = eng.EngineConfig(num_slots=2, capacity=64)
    big = list(range(1, 65))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a table of this host, dtype and size: no warning
        eng.Engine(model, drafter, "dspark", cfg, sps=table(big, backend="cpu", device_kind="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="--allow-sps-mesh-mismatch"):
        eng.Engine(model, drafter, "dspark", cfg, sps=table(big, extra={"mesh": {"data": 2, "tensor": 1}}))
    with pytest.warns(UserWarning, match="mesh"):
        eng.Engine(model, drafter, "dspark", cfg, sps=table(big, extra={"mesh": {"data": 2, "tensor": 1}}),
                   allow_sps_mesh_mismatch=True)
    for field, value in (("backend", "tpu"), ("device_kind", "NVIDIA H100 80GB HBM3"), ("dtype", "bfloat16")):
        with pytest.warns(UserWarning, match=f"measured with {field}={value!r}"):
            eng.Engine(model, drafter, "dspark", cfg, sps=table(big, **{field: value}))
    with pytest.warns(UserWarning, match=r"measured up to 8 verified tokens, but this engine's 2 slots may verify 10 tokens"):
        eng.Engine(model, drafter, "dspark", cfg, sps=table(list(range(1, 9))))
