"""Loss terms against NumPy, checkpoint save / restore / resume, drafter export."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_jax import data, training
from dspark_jax.models import drafter as dr
from dspark_jax.models import drafter_files
from dspark_jax.models.llama import LlamaConfig, init_random_weights

TARGET = LlamaConfig.tiny()
G = 3


def tiny_drafter(head="markov", confidence=True, vocab_ids=None, seed=0):
    cfg = dr.DrafterConfig.for_target(TARGET, head=head, confidence=confidence, rank=4, block=G, n_layers=1,
                                      ffn_dim=16, draft_vocab_size=0 if vocab_ids is None else len(vocab_ids))
    d = dr.Drafter(cfg, rngs=nnx.Rngs(seed), vocab_ids=vocab_ids)
    if head != "none":
        d.w2.kernel[...] = 0.3 * jax.random.normal(jax.random.key(seed + 7), d.w2.kernel[...].shape)
    return d


def fake_cache(n_seq=6, seed=0):
    """A TargetCache of random sequences with consistent lse (from the tiny target's tied head)."""
    rng = np.random.default_rng(seed)
    w = init_random_weights(TARGET, jax.random.key(1))
    lengths = rng.integers(12, 30, size=n_seq)
    prompt = rng.integers(3, 8, size=n_seq)
    T = int(lengths.sum())
    final = rng.normal(size=(T, TARGET.dim)).astype(np.float16).astype(np.float32)
    logits = final @ np.asarray(w.embed).T
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return w, data.TargetCache(
        tokens=rng.integers(0, TARGET.vocab_size, size=T).astype(np.int32),
        taps=rng.normal(size=(T, 5, TARGET.dim)).astype(data.BF16),
        final=final.astype(np.float16),
        lse=lse.astype(np.float32),
        offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]),
        lengths=lengths,
        prompt_lengths=prompt,
        domains=["x"] * n_seq,
    )


def loader_for(cache, seed=0):
    return data.BlockLoader(cache, block=G, buckets=(32,), context_tokens=64, blocks=8, seed=seed)


def test_loader_blocks_follow_the_spec():
    _, cache = fake_cache()
    b = loader_for(cache).batch(0)
    N, B = b.anchors.shape
    assert b.taps.shape == (N, 32, 5, TARGET.dim) and b.valid.shape == (N, B, G)
    np.testing.assert_array_equal(loader_for(cache).batch(3).anchors, loader_for(cache).batch(3).anchors)
    # anchors are assistant positions with an assistant successor, without repeats within a sequence
    for i in range(N):
        rows = b.anchors[i][b.valid[i, :, 0]]
        assert len(set(rows.tolist())) == len(rows)


def test_default_buckets_hold_every_sequence_and_explicit_ones_count_what_they_skip():
    _, cache = fake_cache()
    lengths = cache.lengths.copy()
    lengths[0] = 1100  # one sequence past 1024 tokens: the default buckets grow to 1536 to hold it
    long = dataclasses.replace(cache, lengths=lengths)
    every = data.BlockLoader(long, block=G, context_tokens=4096, blocks=8)
    assert every.buckets == (256, 512, 1024, 1536) and every.skipped == 0
    assert 0 in every.groups[1536]
    capped = data.BlockLoader(long, block=G, buckets=(256, 512, 1024), context_tokens=4096, blocks=8)
    assert capped.skipped == 1 and all(0 not in g for g in capped.groups.values())
    assert capped.num_tokens == every.num_tokens - 1100
    assert capped.num_sequences == every.num_sequences - 1 == long.num_sequences - 1


def test_batches_hold_a_multiple_of_the_data_parallel_devices():
    _, cache = fake_cache(n_seq=12)
    one = data.BlockLoader(cache, block=G, buckets=(32,), context_tokens=96, blocks=12)  # 3 sequences a batch
    two = data.BlockLoader(cache, block=G, buckets=(32,), context_tokens=96, blocks=12, sequences_multiple=2)
    assert one.batch(0).tokens.shape[0] == 3 and two.batch(0).tokens.shape[0] == 2
    assert two.batch(0).anchors.shape == (2, 6)  # blocks per sequence follow N
    few = data.BlockLoader(cache, block=G, buckets=(32,), context_tokens=32, blocks=12, sequences_multiple=4)
    assert few.batch(0).tokens.shape[0] == 4  # at least one multiple, even past the context asked for


def numpy_loss(d, batch, w_embed, loss_cfg):
    """Loss terms recomputed in NumPy from the drafter's logits and the stored target state."""
    head_w = dr.draft_head_weights(d, w_embed)
    tokens, anchors = batch["tokens"], batch["anchors"]
    N, S = tokens.shape
    ctx_k, ctx_v = d.context_kv(jnp.asarray(batch["taps"], jnp.float32), jnp.broadcast_to(jnp.arange(S), (N, S)))
    mask = np.arange(S)[None, None, :] < anchors[..., None]
    h = d.hidden(ctx_k, ctx_v, mask, np.take_along_axis(tokens, anchors, 1), anchors, w_embed)
    pos = np.clip(anchors[..., None] + np.arange(G), 0, S - 1)
    prev = np.take_along_axis(tokens[:, None, :], pos, 2)
    labels = np.take_along_axis(tokens[:, None, :], np.clip(pos + 1, 0, S - 1), 2)
    logits, conf = (np.asarray(x, np.float64) for x in d.teacher_forced(h, prev, head_w))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    p_d = np.exp(logp)
    full_logits = np.asarray(batch["final"], np.float64) @ np.asarray(w_embed, np.float64).T  # [N,B,G,V]
    p_t_full = np.exp(full_logits - np.asarray(batch["lse"], np.float64)[..., None])
    ids = np.asarray(d.vocab_ids[...])
    p_d_full = np.zeros_like(p_t_full)
    p_d_full[..., ids] = p_d
    l1 = np.abs(p_d_full - p_t_full).sum(-1)
    c_star = np.clip(1 - l1 / 2, 0, 1)
    to_draft = np.asarray(d.to_draft[...])
    li = to_draft[labels]
    inv = li < len(ids)
    ce = -np.take_along_axis(logp, np.minimum(li, len(ids) - 1)[..., None], -1)[..., 0]
    sig = 1 / (1 + np.exp(-conf))
    bce = -(c_star * np.log(sig) + (1 - c_star) * np.log(1 - sig))
    soft_ce = -(p_t_full[..., ids] * logp).sum(-1)
    w = np.exp(-np.arange(G) / 4.0) * batch["valid"]
    mean = lambda x, ww: (x * ww).sum() / ww.sum()  # noqa: E731
    return {"ce": mean(ce, w * inv), "l1": mean(l1, w), "conf": mean(bce, w), "kl": mean(soft_ce, w)}


@pytest.mark.parametrize("vocab", [None, np.array([0, 2, 3, 5, 8, 13, 21, 34, 40, 55, 60])])
def test_loss_terms_match_numpy(vocab):
    w, cache = fake_cache()
    d = tiny_drafter(vocab_ids=vocab)
    b = loader_for(cache).batch(1)
    batch = {k: getattr(b, k) for k in ("taps", "tokens", "anchors", "valid", "final", "lse")}
    head_w = dr.draft_head_weights(d, w.embed)
    loss, m = training.block_loss(d, jax.tree.map(jnp.asarray, batch), w.embed, head_w, training.LossConfig())
    ref = numpy_loss(d, batch, w.embed, training.LossConfig())
    for k in ("ce", "l1", "conf", "kl"):
        np.testing.assert_allclose(float(m[k]), ref[k], rtol=2e-3, err_msg=k)
    np.testing.assert_allclose(float(loss), 0.1 * ref["ce"] + 0.9 * ref["l1"] + ref["conf"], rtol=2e-3)
    distilled, _ = training.block_loss(d, jax.tree.map(jnp.asarray, batch), w.embed, head_w,
                                       training.LossConfig(kl=0.5))
    np.testing.assert_allclose(float(distilled), float(loss) + 0.5 * ref["kl"], rtol=2e-3)


def test_validation_metrics_are_held_out_and_logged(tmp_path):
    w, cache = fake_cache()
    _, held_out = fake_cache(n_seq=4, seed=7)
    tc = training.TrainConfig(steps=4, log_every=2, ckpt_every=4, lr=1e-2, val_every=2, val_batches=2)
    d = training.train(tiny_drafter(), loader_for(cache), w.embed, None, tc=tc, loss_cfg=training.LossConfig(),
                       run_dir=tmp_path / "run", progress=False, val_loader=loader_for(held_out))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_tau_prob" in r] == [2, 4]
    # the logged value is the held-out batches' loss under the final parameters, recomputed here
    again = training.validate_drafter(d, loader_for(held_out), w.embed, None, loss_cfg=training.LossConfig(),
                                      batches=2)
    np.testing.assert_allclose(rows[-1]["val_loss"], again["val_loss"], rtol=1e-5)
    assert again["val_tau_prob"] == training.probabilistic_tau(np.asarray(again["val_c_star"]))
    assert 1.0 <= again["val_tau_prob"] <= 1.0 + G


class InterruptedLoader:
    """A loader whose batch at step ``at`` raises ``error`` instead: a run interrupted there."""

    def __init__(self, inner, at, error):
        self.inner, self.at, self.error = inner, at, error

    def batch(self, step):
        if step == self.at:
            raise self.error
        return self.inner.batch(step)


def test_checkpoint_resume_reproduces_uninterrupted_run(tmp_path):
    w, cache = fake_cache()
    tc = training.TrainConfig(steps=6, log_every=2, ckpt_every=2, lr=1e-2)
    full = training.train(tiny_drafter(), loader_for(cache), w.embed, None, tc=tc, loss_cfg=training.LossConfig(),
                          run_dir=tmp_path / "full", progress=False)
    # Interrupted: stop after 4 steps (same schedule), then resume to 6.
    tc4 = training.TrainConfig(steps=6, log_every=2, ckpt_every=2, lr=1e-2)

    class Stop(Exception):
        pass

    with pytest.raises(Stop):
        training.train(tiny_drafter(), InterruptedLoader(loader_for(cache), 4, Stop), w.embed, None, tc=tc4,
                       loss_cfg=training.LossConfig(), run_dir=tmp_path / "cut", progress=False)
    resumed = training.train(tiny_drafter(seed=99), loader_for(cache), w.embed, None, tc=tc4,
                             loss_cfg=training.LossConfig(), run_dir=tmp_path / "cut", progress=False)
    a, b = nnx.state(full, nnx.Param), nnx.state(resumed, nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)
    steps = [json.loads(l)["step"] for l in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]


def test_ctrl_c_checkpoints_the_steps_since_the_last_save(tmp_path):
    """A KeyboardInterrupt between checkpoints saves the step it reached; the resumed run equals an
    uninterrupted one, and a metrics line cut short by the interruption does not stop the resume."""
    import orbax.checkpoint as ocp

    w, cache = fake_cache()
    tc = training.TrainConfig(steps=6, log_every=2, ckpt_every=4, lr=1e-2)
    full = training.train(tiny_drafter(), loader_for(cache), w.embed, None, tc=tc, loss_cfg=training.LossConfig(),
                          run_dir=tmp_path / "full", progress=False)

    with pytest.raises(KeyboardInterrupt):
        training.train(tiny_drafter(), InterruptedLoader(loader_for(cache), 3, KeyboardInterrupt), w.embed, None,
                       tc=tc, loss_cfg=training.LossConfig(), run_dir=tmp_path / "cut", progress=False)
    with ocp.CheckpointManager(tmp_path / "cut" / "ckpt") as mgr:
        assert mgr.latest_step() == 3  # not 0: the three steps since the start were kept
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a line cut short
    resumed = training.train(tiny_drafter(seed=99), loader_for(cache), w.embed, None, tc=tc,
                             loss_cfg=training.LossConfig(), run_dir=tmp_path / "cut", progress=False)
    a, b = nnx.state(full, nnx.Param), nnx.state(resumed, nnx.Param)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)
    assert [r["step"] for r in training.metric_rows(tmp_path / "cut" / "metrics.jsonl")] == [2, 4, 6]


def test_save_and_load_drafter(tmp_path):
    vocab = np.array([1, 4, 9, 16, 25, 36, 49])
    d = tiny_drafter(vocab_ids=vocab)
    drafter_files.save_drafter(d, tmp_path / "dr", extra={"sts_temperatures": [1.0, 2.0, 3.0]})
    drafter_files.save_drafter(d, tmp_path / "dr")  # overwrite in place
    back, meta = drafter_files.load_drafter(tmp_path / "dr")
    assert back.cfg == d.cfg
    a, b = nnx.state(d), nnx.state(back)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4), a, b)
    np.testing.assert_array_equal(back.vocab_ids[...], vocab)
    with pytest.raises(ValueError, match="config.json and weights.npz"):
        drafter_files.load_drafter(tmp_path / "nothing")


def test_quantize_int8_error_is_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(37, 11)).astype(np.float32) * rng.uniform(0.01, 10, size=(1, 11))
    w[:, 3] = 0.0  # an all-zero channel must not divide by zero
    for axis in (0, 1):
        q, scale = drafter_files.quantize_int8(w, axis=axis)
        assert q.dtype == np.int8 and scale.shape[axis] == 1
        assert np.all(np.abs(q.astype(np.float32) * scale - w) <= scale / 2 + 1e-7)
        assert np.max(np.abs(q)) == 127  # the range is used


def test_int8_drafter_round_trip_and_attach(tmp_path, monkeypatch):
    monkeypatch.setattr(drafter_files, "INT8_MIN_SIZE", 16)  # the tiny drafter's matrices are small
    vocab = np.arange(40)
    d = tiny_drafter(vocab_ids=vocab, seed=3)
    side = tmp_path / "sts.json"
    side.write_text('{"temperatures": [1.0]}')
    drafter_files.save_drafter(d, tmp_path / "q", quantize="int8", attach=[side])
    stored = np.load(tmp_path / "q" / "weights.npz")
    quantized = [k for k in stored.files if stored[k].dtype == np.int8]
    assert "w1/embedding" in quantized and "w2/kernel" in quantized
    assert stored["w1/embedding@scale"].shape == (stored["w1/embedding"].shape[0], 1)  # per row
    assert stored["w2/kernel@scale"].shape == (1, stored["w2/kernel"].shape[1])  # per output column
    assert (tmp_path / "q" / "sts.json").read_text() == side.read_text()
    back, _ = drafter_files.load_drafter(tmp_path / "q")
    restored = dict(nnx.to_flat_state(nnx.state(back, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(d, nnx.Param)):
        key = "/".join(map(str, path))
        a, b = np.asarray(var[...]), np.asarray(restored[path][...])
        tol = np.max(np.abs(a)) / 254 + 1e-7 if key in quantized else 1e-3 * np.max(np.abs(a)) + 1e-6
        np.testing.assert_allclose(b, a, rtol=0, atol=tol, err_msg=key)
    # A scale lost from the file is an error, not silently wrong weights.
    weights = dict(stored)
    del weights["w2/kernel@scale"]
    np.savez(tmp_path / "q" / "weights.npz", **weights)
    with pytest.raises(ValueError, match="w2/kernel is stored as int8"):
        drafter_files.load_drafter(tmp_path / "q")
    with pytest.raises(ValueError, match="would overwrite"):
        drafter_files.save_drafter(d, tmp_path / "r", attach=[tmp_path / "q" / "config.json"])
    with pytest.raises(ValueError, match="quantize='int4'"):
        drafter_files.save_drafter(d, tmp_path / "r", quantize="int4")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=5), st.data())
def test_stacked_rows_index_as_the_concatenation(lens, draw):
    parts = [np.arange(2 * sum(lens[:i]), 2 * sum(lens[: i + 1])).reshape(-1, 2) for i in range(len(lens))]
    full, rows = np.concatenate(parts), data.StackedRows(parts)
    T = len(full)
    ends = st.integers(-T - 2, T + 2)
    cut = slice(draw.draw(ends), draw.draw(ends), draw.draw(st.sampled_from([None, 1, 2, -1])))
    np.testing.assert_array_equal(rows[cut], full[cut])
    idx = np.array(draw.draw(st.lists(st.integers(-T, T - 1), max_size=8)) if T else [], np.int64)
    np.testing.assert_array_equal(rows[idx], full[idx])
    np.testing.assert_array_equal(rows[idx.reshape(-1, 1)], full[idx.reshape(-1, 1)])
    with pytest.raises(IndexError, match="out of range"):
        rows[np.array([T])]


def test_stacked_rows_refuse_parts_that_do_not_stack():
    with pytest.raises(ValueError, match="differ in dtype or row shape"):
        data.StackedRows([np.zeros((2, 3)), np.zeros((2, 4))])
    with pytest.raises(TypeError, match="integer rows"):
        data.StackedRows([np.zeros((2, 3))])[np.array([0.5])]


def test_target_cache_build_is_incremental_and_consistent(tmp_path):
    from dspark_jax.models.llama import LlamaModel, logits_from_hidden

    w = init_random_weights(TARGET, jax.random.key(3), scale=0.3)
    model = LlamaModel(TARGET, w, None)
    rng = np.random.default_rng(0)

    def rec(i):
        return {"index": i, "domain": "x", "skipped": False, "prompt_ids": rng.integers(1, 64, 5).tolist(),
                "output_ids": rng.integers(1, 64, 7).tolist()}

    chunks = {"chunk_00000": [rec(0), rec(1)]}
    data.build_target_cache(model, chunks, tmp_path, progress=False)
    first = (tmp_path / "chunk_00000.taps.npy").stat().st_mtime_ns
    chunks["chunk_00001"] = [rec(2)]
    data.build_target_cache(model, chunks, tmp_path, progress=False)
    assert (tmp_path / "chunk_00000.taps.npy").stat().st_mtime_ns == first  # kept, not rebuilt
    cache = data.open_target_cache(tmp_path)
    assert cache.num_sequences == 3 and list(cache.lengths) == [12, 12, 12]
    seq = chunks["chunk_00001"][0]
    ids = seq["prompt_ids"] + seq["output_ids"]
    logits = np.asarray(model.score(ids))
    off = int(cache.offsets[2])
    np.testing.assert_array_equal(cache.tokens[off : off + 12], ids)
    final = cache.final[off : off + 12].astype(np.float32)
    want_lse = np.asarray(jax.nn.logsumexp(logits_from_hidden(w, jnp.asarray(final)), axis=-1))
    np.testing.assert_allclose(cache.lse[off : off + 12], want_lse, rtol=1e-5)
    np.testing.assert_allclose(final @ np.asarray(w.embed).T, logits, rtol=0.02, atol=0.05)  # float16 storage
    # Two shards: the hidden states stay on disk, and batches are those of the same cache held in memory.
    assert isinstance(cache.taps, data.StackedRows) and isinstance(cache.final, data.StackedRows)
    whole = dataclasses.replace(cache, taps=cache.taps[:], final=cache.final[:])
    assert isinstance(whole.taps, np.ndarray)
    a = data.BlockLoader(cache, block=G, buckets=(16,), context_tokens=32, blocks=8, seed=1).batch(0)
    b = data.BlockLoader(whole, block=G, buckets=(16,), context_tokens=32, blocks=8, seed=1).batch(0)
    for f in dataclasses.fields(a):
        np.testing.assert_array_equal(getattr(a, f.name), getattr(b, f.name))
    # the same folder built from other data, or for a target tapping other layers, is refused by name
    other = {"chunk_00000": [rec(0), rec(1)], "chunk_00001": chunks["chunk_00001"]}
    with pytest.raises(ValueError, match="chunk_00000.tokens.npy: the shard holds other sequences"):
        data.build_target_cache(model, other, tmp_path, progress=False)
    tapped = LlamaModel(dataclasses.replace(TARGET, tap_layers=(0,)), w, None)
    with pytest.raises(ValueError, match="a cache of a target with tap layers"):
        data.build_target_cache(tapped, chunks, tmp_path, progress=False)


def test_target_cache_shares_a_prompt_pass_without_changing_rows(tmp_path, monkeypatch):
    """Samples of one prompt share its pass; every stored row is the whole sequence's own pass, whatever the
    prompt and answer lengths (padding inside a chunk, answers crossing chunk boundaries)."""
    from dspark_jax.models.llama import LlamaModel, logits_from_hidden

    w = init_random_weights(TARGET, jax.random.key(4), scale=0.3)
    model = LlamaModel(TARGET, w, None)
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 64, 70).tolist()  # pads to 128: its padded rows are overwritten by each answer
    answers = [rng.integers(1, 64, n).tolist() for n in (3, 65, 130, 300)]  # 300: a second chunk
    other = rng.integers(1, 64, 9).tolist()
    recs = [{"index": 0, "domain": "x", "prompt_ids": prompt, "output_ids": a} for a in answers]
    recs.append({"index": 1, "domain": "x", "prompt_ids": other, "output_ids": answers[0]})
    assert [len(g) for g in data._prompt_groups(recs)] == [4, 1]
    prefills = []
    real = model.prefill
    monkeypatch.setattr(model, "prefill", lambda *a, **k: prefills.append(len(a[1])) or real(*a, **k))
    data.build_target_cache(model, {"chunk_00000": recs}, tmp_path, progress=False)
    monkeypatch.undo()
    assert sorted(prefills) == sorted([128, 64, 128, 192, 320, 64, 64])  # the prompt's pass once per group
    cache = data.open_target_cache(tmp_path)
    assert list(cache.lengths) == [73, 135, 200, 370, 12]
    for i, r in enumerate(recs):
        ids = r["prompt_ids"] + r["output_ids"]
        n = len(ids)
        _, ex, _ = model.prefill(model.init_cache(1, 512), ids, 0, return_extras=True)
        off = int(cache.offsets[i])
        np.testing.assert_array_equal(cache.tokens[off:off + n], ids)
        np.testing.assert_allclose(cache.final[off:off + n].astype(np.float32), np.asarray(ex.final_hidden),
                                   rtol=2e-3, atol=2e-3)  # float16 storage
        np.testing.assert_allclose(cache.taps[off:off + n].astype(np.float32),
                                   np.asarray(ex.taps), rtol=1e-2, atol=1e-2)  # bfloat16 storage
        want_lse = jax.nn.logsumexp(logits_from_hidden(w, jnp.asarray(cache.final[off:off + n], jnp.float32)), -1)
        np.testing.assert_allclose(cache.lse[off:off + n], np.asarray(want_lse), rtol=1e-5)
    with pytest.raises(ValueError, match="record 1 .* 0 answer tokens; expected at least one each"):
        data.build_target_cache(model, {"chunk_00001": [dict(recs[-1], output_ids=[])]}, tmp_path / "bad",
                                progress=False)


def test_pack_drafter_carries_side_files_and_shrinks_storage(tmp_path, monkeypatch, capsys):
    from train import pack_drafter

    monkeypatch.setattr(drafter_files, "INT8_MIN_SIZE", 16)
    src = tmp_path / "run" / "export"
    drafter_files.save_drafter(tiny_drafter(vocab_ids=np.arange(40), seed=5), src, extra={"training": {"steps": 3}})
    (src / "sts.json").write_text('{"temperatures": [1.0, 2.0]}')
    (tmp_path / "run" / "training.png").write_bytes(b"png")
    out = pack_drafter.pack(src, tmp_path / "ship", int8=True)
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "sts.json", "training.png", "weights.npz"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["training"] == {"steps": 3} and meta["storage"].startswith("int8")
    assert (out / "weights.npz").stat().st_size < (src / "weights.npz").stat().st_size
    with pytest.raises(SystemExit):  # parser errors: status 2, the message on stderr
        pack_drafter.main(["--draft", str(src), "--out", str(src)])
    assert "--out must differ" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pack_drafter.main(["--draft", str(tmp_path), "--out", str(tmp_path / "x")])
    assert f"--draft {tmp_path}: expected a drafter folder" in capsys.readouterr().err
