"""Grammar-constrained decoding (`dspark_jax.grammar`): the masked target law is what speculation reproduces, exactly
(enumeration on a tiny vocabulary, with drafts the grammar forbids), greedy constrained output is plain constrained
decoding's under every policy, and constraints are checked when built."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import engine as eng
from dspark_jax import grammar, verify
from dspark_jax.decoding import plain_generate
from dspark_jax.tokenizer import Tokenizer
from tests.helpers import assert_follows_law
from tests.test_engine import make_drafter, make_model

# A byte-level vocabulary of 64 tokens for the tiny models: the stop token, a space and 62 printable characters.
CHARS = ["Ġ"] + list("0123456789abcdefghijklmnopqrstuvwxyz{}[]\":,.-ABCDEFGHIJKLMNOP")


def tiny_tokenizer(chars=CHARS):
    return Tokenizer(["<|im_end|>"] + chars, [], [3] + [1] * len(chars), eos_id=0)


@pytest.fixture(scope="module")
def tok64():
    return grammar.grammar_tokenizer(tiny_tokenizer(), 64, [0])


# ---------------------------------------------------------------------------------------------------- masks


def test_masks_follow_the_drafts_and_stop_at_the_first_forbidden_one(tok64):
    """fill_first / fill_drafts: the mask after the output so far, then after each allowed draft; the count of
    allowed drafts read from the bits (the verification program's count) matches llguidance's own; the matcher's
    state is left as it was; unconstrained rows allow every token."""
    tk = tiny_tokenizer()
    g = grammar.Grammar.regex(r"ab(c|d)+e", tok64)
    m = g.matcher()
    assert m.advance(tk.encode("a")) is None
    drafts = np.array([tk.encode("bccxe"), tk.encode("bcdce"), tk.encode("zzzzz")])
    out = np.empty((4, 6, grammar.mask_words(64)), np.int32)
    matchers = [m, m, m, None]
    grammar.fill_first(matchers, out)
    ok = grammar.fill_drafts(matchers, np.vstack([drafts, drafts[:1]]), np.array([5, 4, 5, 2]), out)
    assert ok.tolist() == [3, 4, 0, 2]
    assert [m._m.validate_tokens(d.tolist()) for d in drafts] == [3, 5, 0]
    assert grammar.allowed(out[0, 0], tk.encode("b")[0]) and not grammar.allowed(out[0, 0], tk.encode("c")[0])
    assert (out[3] == -1).all()
    np.testing.assert_array_equal(np.asarray(grammar.device_leading_allowed(
        jnp.asarray(out.view(np.uint32)), jnp.asarray(np.vstack([drafts, drafts[:1]]), jnp.int32),
        jnp.array([5, 4, 5, 2], jnp.int32))), ok)
    # the state is the one after "a": "bcde" completes it, and the grammar is finished there
    assert m.advance(tk.encode("bcde")) == 4 and m.finished


def test_stop_tokens_only_where_the_grammar_is_complete(tok64):
    tk = tiny_tokenizer()
    m = grammar.Grammar.regex(r"a+", tok64).matcher()
    words = np.empty(grammar.mask_words(64), np.int32)
    m.fill(words)
    assert not grammar.allowed(words, 0)
    m.advance(tk.encode("a"))
    m.fill(words)
    assert grammar.allowed(words, 0) and grammar.allowed(words, tk.encode("a")[0])
    assert m.advance([0]) == 1 and m.finished


@pytest.mark.parametrize("build,arg,message", [
    (grammar.Grammar.json_schema, {"type": "nosuch"}, "invalid JSON schema"),
    (grammar.Grammar.json_schema, "{not json", "not JSON"),
    (grammar.Grammar.json_schema, [1, 2], "expected a JSON object"),
    (grammar.Grammar.regex, "[a-", "(?s)invalid regular expression.*unclosed"),
    (grammar.Grammar.choice, [], "non-empty list"),
    (grammar.Grammar.lark, "start: nosuch", "invalid grammar"),
])
def test_invalid_constraints_are_refused_when_built(tok64, build, arg, message):
    with pytest.raises(grammar.GrammarError, match=message):
        build(arg, tok64)


def test_apply_mask():
    logits = jnp.arange(40, dtype=jnp.float32)
    words = jnp.array([0b1001, 1 << 3], jnp.uint32)  # tokens 0, 3 and 35
    got = np.asarray(grammar.apply_mask(logits, words))
    assert np.isfinite(got).nonzero()[0].tolist() == [0, 3, 35]
    # nothing allowed: a position no row verifies keeps its logits (no NaN downstream)
    np.testing.assert_array_equal(grammar.apply_mask(logits, jnp.zeros(2, jnp.uint32)), logits)


# ---------------------------------------------------------------------------------------------------- exact law
V, G, M = 4, 2, 3  # vocabulary, drafts per round, stream length


def toy_mask(prefix):
    """A grammar over 4 tokens that depends on the whole prefix: token (sum of prefix) % 4 is forbidden, and so
    is token 3 after a 1."""
    allowed = np.ones(V, bool)
    allowed[sum(prefix) % V] = False
    if prefix and prefix[-1] == 1:
        allowed[3] = False
    return allowed


def masked(p, allowed):
    q = np.where(allowed, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("length", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_verification_law_is_the_masked_target_law(length, seed):
    """One verification round as the engine runs it with a grammar, by exact enumeration over every draft block
    (drafts drawn from an unmasked drafter, so many are forbidden): the target's logits masked by the grammar's
    state after the tokens before each position (`grammar.apply_mask`), the target pass cut at the first
    forbidden draft (the logits past it are garbage, as the packed batch leaves them), that draft still in the
    acceptance rule, then plain masked sampling. The stream's law equals the masked target's, exactly."""
    rng = np.random.default_rng(seed)
    logit = {p: rng.normal(size=V) * 1.5 for n in range(M + 1) for p in itertools.product(range(V), repeat=n)}
    pdraft = {p: rng.dirichlet(np.full(V, 0.6)) for n in range(G) for p in itertools.product(range(V), repeat=n)}
    softmax = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    pt = {p: masked(softmax(x), toy_mask(p)) for p, x in logit.items()}
    want = np.zeros((V,) * M)
    for z in itertools.product(range(V), repeat=M):
        want[z] = np.prod([pt[z[:i]][z[i]] for i in range(M)])

    drafts = np.array(list(itertools.product(range(V), repeat=G)))  # every block [N, G]
    N = len(drafts)
    words = np.zeros((N, G + 1, 1), np.uint32)  # packed masks after the anchor and each allowed draft
    for i, d in enumerate(drafts):
        for j in range(G + 1):
            if j == 0 or toy_mask(tuple(d[: j - 1]))[d[j - 1]]:
                words[i, j, 0] = sum(1 << v for v in range(V) if toy_mask(tuple(d[:j]))[v])
            else:
                break
    lengths = jnp.full((N,), length, jnp.int32)
    ok = grammar.device_leading_allowed(jnp.asarray(words), jnp.asarray(drafts, jnp.int32), lengths)
    target_len, accept_len = jnp.minimum(lengths, ok), jnp.minimum(lengths, ok + 1)
    raw = np.array([[logit[tuple(d[:j])] for j in range(G + 1)] for d in drafts], np.float32)
    # positions past the target's pass hold another row's logits in the engine: garbage here
    past = np.arange(G + 1)[None, :] > np.asarray(target_len)[:, None]
    raw = np.where(past[..., None], rng.normal(size=raw.shape) * 9, raw).astype(np.float32)
    target_probs = jax.nn.softmax(grammar.apply_mask(jnp.asarray(raw), jnp.asarray(words)), axis=-1)
    dp = np.array([[pdraft[tuple(d[:k])] for k in range(G)] for d in drafts], np.float32)
    acc = np.asarray(verify.acceptance_probs(jnp.asarray(drafts), dp, target_probs), np.float64)
    accept_len = np.asarray(accept_len)
    law = np.zeros((V,) * M)
    for n in range(G + 1):
        nxt = np.asarray(verify.next_token_probs(dp, target_probs, jnp.full((N,), n), jnp.asarray(accept_len)),
                         np.float64)
        for i, d in enumerate(drafts):
            if n > accept_len[i]:
                continue
            p_draft = np.prod([dp[i, k, d[k]] for k in range(G)])
            p_n = np.prod(acc[i, :n]) * ((1 - acc[i, n]) if n < accept_len[i] else 1.0)
            for z in itertools.product(range(V), repeat=M):
                if tuple(z[:n]) != tuple(d[:n]):
                    continue
                tail = np.prod([pt[z[:j]][z[j]] for j in range(n + 1, M)])
                law[z] += p_draft * p_n * nxt[i, z[n]] * tail
    assert (np.asarray(ok) < length).any() or length == 0  # forbidden drafts were verified
    np.testing.assert_allclose(law, want, atol=2e-6)


def test_cutting_at_a_forbidden_draft_without_its_rejection_would_be_biased():
    """Why the forbidden draft stays in the acceptance rule: drawing the bonus from the masked target instead of
    the residual (as if the target had not been asked about it) gives another first-token law."""
    pt = np.array([0.0, 0.7, 0.3])  # masked target: token 0 forbidden
    pd = np.array([0.5, 0.2, 0.3])  # the drafter proposes token 0 half the time
    acc = np.minimum(1, pt / pd)
    residual = np.maximum(pt - pd, 0) / np.maximum(pt - pd, 0).sum()
    exact = sum(pd[x] * (acc[x] * np.eye(3)[x] + (1 - acc[x]) * residual) for x in range(3))
    biased = sum(pd[x] * ((acc[x] * np.eye(3)[x] + (1 - acc[x]) * residual) if x else pt) for x in range(3))
    np.testing.assert_allclose(exact, pt, atol=1e-12)
    assert np.abs(biased - pt).max() > 0.1


# ---------------------------------------------------------------------------------------------------- engine
SPS = np.linspace(10.0, 1.0, 48).astype(np.float32)


@pytest.fixture(scope="module")
def tiny():
    model = make_model()
    return model, make_drafter(model)


def run(e, reqs):
    ids = [e.submit(p, b, eng.SamplingParams(grammar=g)) for p, b, g in reqs]
    while not e.idle():
        e.step()
    return [e.requests[i] for i in ids]


def test_greedy_constrained_output_equals_plain_constrained_decoding(tiny, tok64):
    """Greedy requests with a regex, a choice list, a JSON schema and none, joining and leaving: every policy gives
    plain constrained decoding's tokens (the ``none`` policy, one request at a time); each constrained answer is in
    its language and ends where its grammar finishes; drafts the grammar forbids were cut."""
    model, d = tiny
    tk = tiny_tokenizer()
    grammars = [grammar.Grammar.regex(r"(yes|no|maybe) [0-9]{1,3}", tok64),
                grammar.Grammar.choice(["abc", "b", "c1d2e3"], tok64), None,
                grammar.Grammar.json_schema({"type": "object", "properties": {"k": {"enum": ["a1", "b22"]}},
                                             "required": ["k"], "additionalProperties": False}, tok64)]
    reqs = [([5, 6, 7 + i], 12 + 2 * i, grammars[i % 4]) for i in range(6)]
    e = eng.Engine(model, None, "none", eng.EngineConfig(num_slots=1, capacity=64), stop_ids=[0])
    ref = [c.output_ids for c in run(e, reqs)]  # one slot: one request at a time
    forbidden = 0
    for policy in ("none", "fixed:3", "dspark"):
        e = eng.Engine(model, d, policy, eng.EngineConfig(num_slots=3, capacity=64), sps=SPS, stop_ids=[0])
        assert [c.output_ids for c in run(e, reqs)] == ref, policy
        forbidden += sum(r.forbidden_drafts for r in e.rounds)
        assert all(r.constrained <= r.active for r in e.rounds)
    texts = [tk.decode(o) for o in ref]
    assert texts[0].split(" ")[0] in ("yes", "no", "maybe") and texts[1] in ("abc", "b", "c1d2e3")
    assert texts[3] in ('{"k": "a1"}', '{"k": "b22"}')
    assert forbidden > 0
    # unconstrained output is what it is without grammars
    plain, _ = plain_generate(model, [reqs[2][0]], reqs[2][1], 0.0, num_slots=1, stop_ids=[0], capacity=64)
    assert ref[2] == plain[0].output_ids


def test_sampled_constrained_output_follows_the_masked_target_law():
    """Sampled requests at temperature 1 on a 4-token model with a regex over its tokens: the engine's outputs
    under ``fixed:2`` (drafts unmasked, many forbidden) follow the masked target law (chi-square at p = 0.001)."""
    tk = tiny_tokenizer(["a", "b", "c"])
    tok4 = grammar.grammar_tokenizer(tk, 4, [0])
    g = grammar.Grammar.regex(r"[ab][bc](a|cc?)", tok4)  # 3 tokens (or 4: the budget ends it)
    model = make_model(vocab=4, scale=0.15, seed=1)
    d = make_drafter(model, seed=2, block=3)
    prompt, m, n_req = [1, 2, 3, 1], 3, 1200
    scores = {}
    law = np.zeros((4,) * m)
    for z in itertools.product(range(4), repeat=m):
        p, mt = 1.0, g.matcher()
        for i in range(m):
            words = np.empty(1, np.int32)
            mt.fill(words)
            if z[:i] not in scores:
                scores[z[:i]] = np.asarray(model.score(prompt + list(z[:i])))[-1]
            logits = scores[z[:i]]
            q = np.exp(logits - logits.max()) * np.array([grammar.allowed(words, v) for v in range(4)])
            p *= q[z[i]] / q.sum()
            if p == 0:
                break
            mt.advance([z[i]])
        law[z] = p
    assert (law == 0).sum() > 40 and abs(law.sum() - 1) < 1e-5
    e = eng.Engine(model, d, "fixed:2", eng.EngineConfig(num_slots=16, capacity=32, temperature=1.0, seed=5),
                   stop_ids=[0])
    ids = [e.submit(prompt, m, eng.SamplingParams(grammar=g)) for _ in range(n_req)]
    while not e.idle():
        e.step()
    outs = [e.requests[i].output_ids for i in ids]
    assert all(len(o) == m for o in outs)
    assert sum(r.forbidden_drafts for r in e.rounds) > 0
    assert_follows_law(outs, law)
