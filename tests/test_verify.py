"""Lossless verification: exact enumeration on a tiny vocabulary and sampled statistics."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import scheduler, verify
from tests.helpers import count_compilations

V, G, M = 3, 2, 3  # vocabulary, drafts per round, stream length checked (G + 1)


def random_dist(rng, zeros=False):
    p = rng.dirichlet(np.full(V, 0.7))
    if zeros and rng.uniform() < 0.5:
        p[rng.integers(V)] = 0.0
        p = p / p.sum()
    return p


class ToyModels:
    """Target and draft next-token laws that depend on the whole prefix (like a Markov draft head)."""

    def __init__(self, seed, zeros=False, draft_equals_target_at=()):
        rng = np.random.default_rng(seed)
        self.pt, self.pd = {}, {}
        for n in range(M + 1):
            for prefix in itertools.product(range(V), repeat=n):
                self.pt[prefix] = random_dist(rng, zeros)
                self.pd[prefix] = random_dist(rng, zeros)
                if n in draft_equals_target_at:
                    self.pd[prefix] = self.pt[prefix].copy()  # residual has no mass: fallback path

    def target_joint(self):
        out = np.zeros((V,) * M)
        for z in itertools.product(range(V), repeat=M):
            out[z] = np.prod([self.pt[z[:i]][z[i]] for i in range(M)])
        return out

    def round_inputs(self, drafts):
        """Arrays for a batch of draft sequences [N, G]: draft_probs [N, G, V], target_probs [N, G+1, V]."""
        dp = np.array([[self.pd[tuple(d[:k])] for k in range(G)] for d in drafts])
        tp = np.array([[self.pt[tuple(d[:k])] for k in range(G + 1)] for d in drafts])
        return dp.astype(np.float32), tp.astype(np.float32)


def exact_stream_law(models, length):
    """Exact law of the first M tokens: one verification round of ``length`` drafts, then plain
    target sampling, using verify's acceptance and next-token probabilities."""
    drafts = np.array(list(itertools.product(range(V), repeat=G)))
    dp, tp = models.round_inputs(drafts)
    acc = np.asarray(verify.acceptance_probs(drafts, dp, tp), np.float64)  # [N, G]
    lengths = np.full(len(drafts), length)
    law = np.zeros((V,) * M)
    for n in range(length + 1):
        nxt = np.asarray(verify.next_token_probs(dp, tp, np.full(len(drafts), n), lengths), np.float64)
        for i, d in enumerate(drafts):
            p_draft = np.prod([dp[i, k, d[k]] for k in range(G)])
            p_n = np.prod(acc[i, :n]) * ((1 - acc[i, n]) if n < length else 1.0)
            for z in itertools.product(range(V), repeat=M):
                if tuple(z[:n]) != tuple(d[:n]):
                    continue
                tail = np.prod([models.pt[z[:j]][z[j]] for j in range(n + 1, M)])
                law[z] += p_draft * p_n * nxt[i, z[n]] * tail
    return law


@pytest.mark.parametrize("length", [0, 1, 2])
@pytest.mark.parametrize("seed,zeros,equal_at", [(0, False, ()), (1, True, ()), (2, False, (0, 1)), (3, True, (1,))])
def test_exact_enumeration_is_lossless(length, seed, zeros, equal_at):
    models = ToyModels(seed, zeros, equal_at)
    np.testing.assert_allclose(exact_stream_law(models, length), models.target_joint(), atol=2e-6)


def sample_streams(models, rng, key, lengths, greedy=False):
    """Sample drafts, verify with speculative_accept (or greedy_accept), continue with the target."""
    n_rows = len(lengths)
    drafts = np.zeros((n_rows, G), int)
    for k in range(G):
        prefixes = [tuple(d[:k]) for d in drafts]
        u = rng.uniform(size=n_rows)
        for i, p in enumerate(prefixes):
            dist = models.pd[p] if not greedy else np.eye(V)[np.argmax(models.pd[p])]
            drafts[i, k] = min(np.searchsorted(np.cumsum(dist), u[i], side="right"), V - 1)
    dp, tp = models.round_inputs(drafts)
    if greedy:
        n, nxt = verify.greedy_accept(drafts, np.log(tp + 1e-30), lengths)
    else:
        n, nxt = verify.speculative_accept(key, drafts, dp, tp, lengths)
    n, nxt = np.asarray(n), np.asarray(nxt)
    streams = np.zeros((n_rows, M), int)
    u = rng.uniform(size=(n_rows, M))
    for i in range(n_rows):
        z = list(drafts[i, : n[i]]) + [nxt[i]]
        while len(z) < M:
            dist = models.pt[tuple(z)]
            if greedy:
                z.append(int(np.argmax(dist)))
            else:
                z.append(min(int(np.searchsorted(np.cumsum(dist), u[i, len(z)], side="right")), V - 1))
        streams[i] = z[:M]
    return streams, n


def test_sampled_acceptance_matches_target_law():
    models = ToyModels(7, zeros=True)
    rng = np.random.default_rng(0)
    n_rows = 60000
    lengths = rng.integers(0, G + 1, size=n_rows).astype(np.int32)  # chosen without looking at drafts
    streams, n = sample_streams(models, rng, jax.random.key(42), lengths)
    assert np.all(n <= lengths)
    counts = np.zeros((V,) * M)
    np.add.at(counts, tuple(streams.T), 1)
    expected = models.target_joint() * n_rows
    mask = expected > 0
    assert counts[~mask].sum() == 0  # never emits a sequence the target cannot produce
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    # 26 degrees of freedom at most; the 0.999 quantile of chi2(26) is 54.05.
    assert chi2 < 54.05, chi2


def test_greedy_accept_is_plain_greedy():
    models = ToyModels(9)
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, G + 1, size=300).astype(np.int32)
    streams, _ = sample_streams(models, rng, None, lengths, greedy=True)
    z = []
    for _ in range(M):
        z.append(int(np.argmax(models.pt[tuple(z)])))
    np.testing.assert_array_equal(streams, np.tile(z, (300, 1)))


def test_greedy_accept_counts_and_bonus():
    logits = np.zeros((3, 4, 5), np.float32)
    best = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    np.put_along_axis(logits, best[..., None], 1.0, axis=-1)
    drafts = np.array([[1, 2, 3], [1, 0, 3], [0, 0, 0]])
    n, nxt = verify.greedy_accept(drafts, logits, np.array([3, 3, 1]))
    np.testing.assert_array_equal(n, [3, 1, 1])
    np.testing.assert_array_equal(nxt, [4, 2, 0])


def test_out_of_range_lengths_are_clipped_and_bad_shapes_named():
    """lengths above G act as G (all drafts, then the bonus from p_t[G]: not a residual) and below 0 as 0, in
    both rules; shapes that do not fit draft_tokens [R, G] are refused naming the argument and the shape
    expected, before anything runs."""
    rng = np.random.default_rng(5)
    dp = rng.dirichlet(np.ones(6), size=(4, 3)).astype(np.float32)
    tp = rng.dirichlet(np.ones(6), size=(4, 4)).astype(np.float32)
    drafts = rng.integers(0, 6, size=(4, 3))
    keys = jax.random.split(jax.random.key(1), 4)
    for wild, tame in (([5, 3, 9, -2], [3, 3, 3, 0]), ([-1, 4, 0, 7], [0, 3, 0, 3])):
        for rule in (lambda L: verify.speculative_accept(keys, drafts, dp, tp, np.array(L)),
                     lambda L: verify.greedy_accept(drafts, tp, np.array(L))):
            np.testing.assert_array_equal(np.stack(rule(wild)), np.stack(rule(tame)))
    full = np.array([3, 3, 3, 3])
    law = verify.next_token_probs(dp, tp, full, np.array([8, 3, 4, 3]))
    np.testing.assert_allclose(law, tp[:, 3], rtol=1e-6)  # the bonus law at every row
    with pytest.raises(ValueError, match=r"greedy_accept: target_logits: expected \[R, G \+ 1, V\]"):
        verify.greedy_accept(drafts, tp[:, :3], full)
    with pytest.raises(ValueError, match=r"speculative_accept: lengths: expected int \[R\] = \[4\]"):
        verify.speculative_accept(keys, drafts, dp, tp, np.array([1, 2]))
    with pytest.raises(ValueError, match=r"speculative_accept: draft_probs: expected \[R, G, V\]"):
        verify.speculative_accept(keys, drafts, tp, tp, full)
    with pytest.raises(ValueError, match=r"draft_tokens: expected int \[R, G\]"):
        verify.greedy_accept_tokens(drafts[0], drafts, full)


def test_low_precision_target_is_renormalised_and_draft_law_must_be_float32():
    """A bfloat16 softmax sums to 1 only within its rounding: the target's law is taken as the renormalised
    float32 rows. The draft law must be float32 as given (a cast copy is not the law the drafts were drawn from,
    so accepting it would bias the output): it is refused by name."""
    rng = np.random.default_rng(6)
    dp = jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 2, 64)) * 2))
    tp = jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 3, 64)) * 2)).astype(jnp.bfloat16)
    assert abs(float(jnp.sum(tp.astype(jnp.float32), -1).max()) - 1.0) > 1e-4  # not normalised as stored
    norm = lambda x: x.astype(jnp.float32) / jnp.sum(x.astype(jnp.float32), -1, keepdims=True)  # noqa: E731
    for n in range(3):
        got = verify.next_token_probs(dp, tp, jnp.full(3, n), jnp.full(3, 2))
        want = verify.next_token_probs(dp, norm(tp), jnp.full(3, n), jnp.full(3, 2))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(jnp.sum(got, -1), 1.0, rtol=1e-6)
    drafts = jnp.asarray(rng.integers(0, 64, size=(3, 2)))
    np.testing.assert_allclose(verify.acceptance_probs(drafts, dp, tp), verify.acceptance_probs(drafts, dp, norm(tp)),
                               rtol=1e-6)
    low = dp.astype(jnp.bfloat16)
    for call in (lambda: verify.acceptance_probs(drafts, low, tp),
                 lambda: verify.next_token_probs(low, tp, jnp.zeros(3, jnp.int32), jnp.full(3, 2)),
                 lambda: verify.speculative_accept(jax.random.key(0), drafts, low, tp, jnp.full(3, 2))):
        with pytest.raises(ValueError, match="draft_probs: expected float32"):
            call()


def test_vocabulary_and_dtype_mismatches_are_refused_by_name():
    rng = np.random.default_rng(7)
    drafts = jnp.asarray(rng.integers(0, 3, size=(2, 2)), jnp.int32)
    dp = jnp.asarray(rng.dirichlet(np.ones(3), size=(2, 2)), jnp.float32)  # [R, G, 3]
    tp = jnp.asarray(rng.dirichlet(np.ones(4), size=(2, 3)), jnp.float32)  # [R, G + 1, 4]
    lengths = jnp.full(2, 2, jnp.int32)
    with pytest.raises(ValueError, match=r"draft_probs: expected \[R, G, V\] over the target's V = 4"):
        verify.speculative_accept(jax.random.key(0), drafts, dp, tp, lengths)
    with pytest.raises(ValueError, match=r"draft_vocab: expected int \[W\] with W = 3"):
        verify.speculative_accept(jax.random.key(0), drafts, dp, tp, lengths, jnp.arange(2))
    n, _ = verify.speculative_accept(jax.random.key(0), drafts, dp, tp, lengths, jnp.array([0, 1, 3]))
    assert n.shape == (2,)
    with pytest.raises(ValueError, match="lengths: expected integer counts"):
        verify.greedy_accept(drafts, tp, lengths.astype(jnp.float32))
    with pytest.raises(ValueError, match="draft_tokens: expected integer token ids"):
        verify.greedy_accept_tokens(drafts.astype(jnp.float32), jnp.zeros((2, 3), jnp.int32), lengths)
    with pytest.raises(ValueError, match="target_tokens: expected integer token ids"):
        verify.greedy_accept_tokens(drafts, jnp.zeros((2, 3), jnp.float32), lengths)


def test_first_argmax_is_argmax_with_nan():
    from dspark_jax.models.llama import first_argmax

    x = jnp.array([[1.0, jnp.nan, 3.0, jnp.nan], [1.0, 5.0, 5.0, 0.0], [jnp.nan, 0.0, 9.0, 1.0]])
    np.testing.assert_array_equal(first_argmax(x), jnp.argmax(x, -1))


def test_per_row_keys_make_rows_independent_of_batch():
    rng = np.random.default_rng(3)
    dp = rng.dirichlet(np.ones(6), size=(4, 3)).astype(np.float32)
    tp = rng.dirichlet(np.ones(6), size=(4, 4)).astype(np.float32)
    drafts = rng.integers(0, 6, size=(4, 3))
    keys = jax.random.split(jax.random.key(0), 4)
    lengths = np.array([3, 2, 1, 0])
    n_all, t_all = verify.speculative_accept(keys, drafts, dp, tp, lengths)
    n_one, t_one = verify.speculative_accept(keys[2:3], drafts[2:3], dp[2:3], tp[2:3], lengths[2:3])
    assert int(n_all[2]) == int(n_one[0]) and int(t_all[2]) == int(t_one[0])


def test_reduced_draft_vocabulary_equals_expanded():
    rng = np.random.default_rng(8)
    vocab = np.array([1, 3, 4, 7])
    dp_small = rng.dirichlet(np.ones(4), size=(5, 3)).astype(np.float32)
    dp_full = np.zeros((5, 3, 9), np.float32)
    dp_full[..., vocab] = dp_small
    tp = rng.dirichlet(np.ones(9), size=(5, 4)).astype(np.float32)
    drafts = vocab[rng.integers(0, 4, size=(5, 3))]
    drafts[0, 1] = 2  # a token outside the draft vocabulary: p_d = 0
    lengths = np.array([3, 2, 1, 0, 3])
    np.testing.assert_array_equal(
        verify.acceptance_probs(drafts, dp_small, tp, vocab), verify.acceptance_probs(drafts, dp_full, tp)
    )
    for n in range(4):
        nn = np.minimum(n, lengths)
        np.testing.assert_allclose(
            verify.next_token_probs(dp_small, tp, nn, lengths, vocab), verify.next_token_probs(dp_full, tp, nn, lengths),
            rtol=1e-6,
        )
    key = jax.random.key(5)
    a = verify.speculative_accept(key, drafts, dp_small, tp, lengths, vocab)
    b = verify.speculative_accept(key, drafts, dp_full, tp, lengths)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_verify_compiles_once():
    rng = np.random.default_rng(4)
    args = lambda: (  # noqa: E731
        rng.integers(0, 6, size=(4, 3)),
        rng.dirichlet(np.ones(6), size=(4, 3)).astype(np.float32),
        rng.dirichlet(np.ones(6), size=(4, 4)).astype(np.float32),
        rng.integers(0, 4, size=4).astype(np.int32),
    )
    jax.block_until_ready(verify.speculative_accept(jax.random.key(0), *args()))
    d, p, t, l = args()
    jax.block_until_ready(verify.greedy_accept(d, t, l))
    with count_compilations() as n:
        jax.block_until_ready(verify.speculative_accept(jax.random.key(1), *args()))
        d, p, t, l = args()
        jax.block_until_ready(verify.greedy_accept(d, t, l))
    assert n() == 0


# ----------------------------------------------------------------------------- appendix A, end to end
A, B = 0, 1
P_T = np.array([0.7, 0.3], np.float32)  # target law of the first token
P_D = np.array([0.5, 0.5], np.float32)  # draft law of x1
SPS_A = np.array([1.0, 1.0, 0.5, 0.45], np.float32)  # SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45


def appendix_round(x1):
    """Confidences recomputed after sampling x1: c2 = 0.9 after A, 0 after B."""
    conf = np.array([[0.8, 0.9 if x1 == A else 0.0]], np.float32)
    drafts = np.array([[x1, A]])
    dp = np.stack([P_D, np.array([0.6, 0.4], np.float32)])[None]
    tp = np.stack([P_T, np.array([0.5, 0.5], np.float32), np.array([0.5, 0.5], np.float32)])[None]
    return conf, drafts, dp, tp


POLICIES = {
    "argmax": lambda conf: scheduler.schedule(conf, SPS_A, stop="argmax").lengths,
    "first_drop": lambda conf: scheduler.schedule(conf, SPS_A).lengths,
    # stale confidences (known before this round's x1): capacity K by argmax, then top-K by current survival
    "capacity_topk": lambda conf: scheduler.top_k_lengths(
        conf, scheduler.capacity(np.array([[0.8, 0.9]], np.float32), SPS_A)
    ),
    "capacity_topk_k1": lambda conf: scheduler.top_k_lengths(conf, jnp.int32(1)),
}
WANT = {"argmax": 0.85, "first_drop": 0.7, "capacity_topk": 0.7, "capacity_topk_k1": 0.7}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_appendix_a_first_token_law(policy):
    exact = 0.0
    keys = jax.random.split(jax.random.key(123), 40000)
    sampled = 0.0
    for x1 in (A, B):
        conf, drafts, dp, tp = appendix_round(x1)
        lengths = np.asarray(POLICIES[policy](conf), np.int32)
        acc = float(verify.acceptance_probs(drafts, dp, tp)[0, 0])
        p_first_a = 0.0
        if lengths[0] >= 1:
            p_first_a += acc * (x1 == A)
        nxt0 = np.asarray(verify.next_token_probs(dp, tp, np.array([0]), lengths))[0]
        p_first_a += (1 - acc if lengths[0] >= 1 else 1.0) * nxt0[A]
        exact += P_D[x1] * p_first_a
        # The same through sampling: half of the keys draw x1 = A.
        rows = len(keys) // 2
        n, nxt = verify.speculative_accept(
            keys[x1 * rows : (x1 + 1) * rows],
            np.repeat(drafts, rows, 0),
            np.repeat(dp, rows, 0),
            np.repeat(tp, rows, 0),
            np.repeat(lengths, rows),
        )
        first = np.where(np.asarray(n) >= 1, x1, np.asarray(nxt))
        sampled += P_D[x1] * np.mean(first == A)
    np.testing.assert_allclose(exact, WANT[policy], atol=1e-6)
    np.testing.assert_allclose(sampled, WANT[policy], atol=0.01)  # ~4 standard errors
