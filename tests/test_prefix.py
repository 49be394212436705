"""Prefix caching in the engine: multi-turn conversations take their earlier turns from the cache, target K/V and
the drafter's context alike, on both KV layouts, and answer exactly what a cold prefill answers."""

import numpy as np
import pytest

from dspark_jax import engine as eng
from dspark_jax.cache.prefix import PrefixStore
from dspark_jax.decoding import plain_generate
from tests.test_engine import SPS

LAYOUTS = ["slots", "pages"]


def conversations(n, turns, *, system=20, seed=0, vocab=64):
    """``n`` conversations sharing a system prompt of ``system`` tokens, ``turns`` user messages each."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, vocab, system).tolist()
    return head, [[rng.integers(1, vocab, int(rng.integers(3, 9))).tolist() for _ in range(turns)]
                  for _ in range(n)]


def chat(e: eng.Engine, head, convs, new_tokens=6):
    """Run every conversation turn by turn, all conversations of a turn together; each turn resends the history
    (system prompt, earlier messages and answers). Returns the answers [conversation][turn]."""
    history = [list(head) for _ in convs]
    answers = [[] for _ in convs]
    for t in range(len(convs[0])):
        ids = []
        for i, conv in enumerate(convs):
            history[i] += conv[t]
            ids.append(e.submit(history[i], new_tokens))
        while not e.idle():
            e.step()
        for i, rid in enumerate(ids):
            out = e.requests[rid].output_ids
            answers[i].append(out)
            history[i] += out
    return answers


def engine(model, drafter, policy, layout, caching, **kw):
    cfg = eng.EngineConfig(num_slots=3, capacity=128, kv_layout=layout, block_size=4, enable_prefix_caching=caching,
                           **kw)
    return eng.Engine(model, drafter, policy, cfg, sps=SPS, stop_ids=[])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["none", "dspark"])
def test_multi_turn_chat_answers_the_same_with_and_without_the_cache(model, drafter, layout, policy):
    head, convs = conversations(3, 3)
    d = None if policy == "none" else drafter
    on, off = engine(model, d, policy, layout, None), engine(model, d, policy, layout, False)
    got, want = chat(on, head, convs), chat(off, head, convs)
    assert got == want
    stats = on.prefix_cache_stats()
    # later turns find their history: at least the system prompt's and the first turn's full pages
    assert stats["hit_rate"] > 0.5 and off.prefix_cache_stats()["cached_tokens"] == 0
    # and greedy is plain decoding: the last turn of the first conversation against a cold plain run
    history = head + [t for turn, a in zip(convs[0][:-1], got[0][:-1]) for t in turn + a] + convs[0][-1]
    ref, _ = plain_generate(model, [history], 6, 0.0, num_slots=1, stop_ids=[], capacity=128)
    assert got[0][-1] == ref[0].output_ids
    if layout == "pages":
        on.pages.check()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_restored_prefix_drafts_as_a_cold_prefill_does(model, drafter, layout):
    """The drafter's context comes back with the target's K/V: the first round's drafts and confidences after
    a cache hit equal those after a cold prefill, bit for bit."""
    prompt = np.random.default_rng(5).integers(1, 64, 41).tolist()
    first = []
    for caching in (None, False):
        e = engine(model, drafter, "fixed:3", layout, caching)
        e.record_tokens = e.record_confidences = True
        e.run([prompt[:30]], 2)  # publishes the first 30 tokens' full pages (with the drafter's context)
        e.rounds.clear()
        rid = e.submit(prompt, 3)
        e.step()
        first.append((e.rounds[0].draft_tokens, e.rounds[0].confidences, e.requests[rid].output_ids))
        assert e.prefix_cache_stats()["cached_tokens"] == (28 if caching is None else 0)
    (d1, c1, o1), (d0, c0, o0) = first
    np.testing.assert_array_equal(d1, d0)
    np.testing.assert_array_equal(c1, c0)
    assert o1 == o0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_small_cache_evicts_and_stays_exact(model, drafter, layout):
    """A pool (pages layout) or store (slot layout) of a fraction of the workload's pages: every answer stays
    exact, pages are evicted, and the hit rate falls instead of anything failing."""
    head, convs = conversations(4, 3, seed=2)
    small = dict(num_pages=24) if layout == "pages" else dict(num_prefix_pages=6)
    on = engine(model, drafter, "dspark", layout, None, **small)
    off = engine(model, drafter, "dspark", layout, False)
    assert chat(on, head, convs) == chat(off, head, convs)
    stats = on.prefix_cache_stats()
    assert stats["evictions"] > 0 and stats["hit_rate"] > 0.1  # still finds the recent, shared pages
    if layout == "pages":
        on.pages.check()
        assert on.pages.used_pages == 0  # every request gave its pages back


def test_no_context_requests_use_pages_written_with_it(model, drafter):
    """A request admitted without the drafter's context takes pages written with it (the target's K/V are the
    same), and the reverse does not happen: a request with the context never restores pages without it."""
    e = engine(model, drafter, "fixed:3", "slots", None)
    prompt = list(range(1, 30))
    ns_ctx = e._namespace(True)
    e.run([prompt[:20]], 2)
    assert e.prefix_store.lookup(prompt, ns_ctx) and not e.prefix_store.lookup(prompt, b"")
    assert len(e._prefix_lookup(prompt, False)) == 5
    plain = engine(model, drafter, "fixed:3", "slots", None)
    plain.prefix_store.add(prompt[:20], b"")
    assert plain._prefix_lookup(prompt, True) == []


def test_cancel_mid_prefill_publishes_nothing(model):
    e = engine(model, None, "none", "pages", None, max_num_batched_tokens=20)
    rid = e.submit(list(range(1, 60)), 4)
    e.step()  # 20 of 59 prompt tokens prefilled
    assert e.prefilling
    e.cancel(rid)
    assert e.pages.cached_pages == 0 and e.pages.used_pages == 0
    e.pages.check()


def test_prefix_store_index():
    store = PrefixStore(num_pages=3, page_size=2)
    a = [1, 2, 3, 4, 5, 6, 7]
    assert store.add(a) == [(0, 0), (1, 1), (2, 2)]
    assert store.add(a) == []  # already stored
    assert store.lookup(a) == [0, 1, 2] and store.lookup(a[:6]) == [0, 1]  # the last token stays to compute
    assert store.lookup(a, b"other") == []  # namespaces do not mix
    assert store.lookup([9, 2, 3, 4, 5]) == []  # same later pages under another first page: other keys
    store.lookup([1, 2, 3])  # page 0 becomes the most recently used
    assert store.add([8, 8, 9]) == [(0, 2)] and store.evictions == 1  # the least recently used (a's third) goes
    assert store.lookup(a) == [0, 1]  # the chain ends where a page went
    # a request longer than the store keeps what fits, never evicting its own pages
    assert [j for j, _ in store.add(list(range(20, 40)))] == [0, 1, 2]
    assert store.stored_pages == 3
    store.clear()
    assert store.stored_pages == 0 and store.lookup(a) == []
    with pytest.raises(ValueError, match="num_pages"):
        PrefixStore(num_pages=0, page_size=2)


def test_configuration_is_checked(model):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        eng.EngineConfig(enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="num_prefix_pages"):
        eng.EngineConfig(num_prefix_pages=0)
    off = engine(model, None, "none", "slots", False)
    assert not off.prefix_caching and off.prefix_store is None
