"""Training-data generation at scale (dspark_jax.datagen): answers independent of slots and prompt sharing,
greedy answers equal plain decoding, sampled answers are the keyed draws from the target's distribution, shards
resume, and settings are checked before work."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.data import Prompt
from dspark_jax.datagen import generate_responses, load_responses, shard_path
from dspark_jax.decoding import plain_generate, sample_tokens
from tests.helpers import small_real_vocab_target

TEMPS = [0.0, 1.0, 0.7]
TURNS = ["Hi", "What is 2 + 2?", "Write a haiku about rain, please, with many many words in it.", "Why?", "Sort"]


@pytest.fixture(scope="module")
def small(target):
    return small_real_vocab_target(target)


def prompts():
    return [Prompt(10 + i, "chat" if i % 2 else "math", (t,)) for i, t in enumerate(TURNS)]


def run(model, out, **kw):
    args = dict(temperatures=TEMPS, max_new_tokens=6, max_prompt_tokens=40, num_slots=4, shard_prompts=2, seed=3,
                model_name="tiny", progress=False, log=lambda m: None)
    args.update(kw)
    return generate_responses(model, prompts(), out, **args)


def records(out):
    return [r for recs in load_responses(out).values() for r in recs]


def test_answers_follow_the_target_and_ignore_slots(small, tmp_path):
    run(small, tmp_path / "a")
    run(small, tmp_path / "b", num_slots=1)
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert a == b  # slots, batch composition and copied prompt rows change nothing
    tok = small.tokenizer
    skipped = [p for p in prompts() if len(tok.encode_chat([p.turns[0]])) > 40]
    assert len(skipped) == 1  # the long prompt is recorded as skipped, not answered
    assert len(a) == (len(TURNS) - 1) * len(TEMPS)
    for r in a:
        assert r["prompt_ids"] == tok.encode_chat([TURNS[r["index"] - 10]])
        assert r["temperature"] == TEMPS[r["sample"]] and 1 <= len(r["output_ids"]) <= 6
        ids = r["prompt_ids"] + r["output_ids"]
        logits = small.score(ids)[len(r["prompt_ids"]) - 1: len(ids) - 1]  # the distribution of each answer token
        n = len(r["output_ids"])
        rid = r["index"] * len(TEMPS) + r["sample"]
        drawn = sample_tokens(logits, 3, jnp.full(n, rid, jnp.int32),
                              jnp.arange(len(r["prompt_ids"]), len(ids), dtype=jnp.int32), r["temperature"])
        assert drawn.tolist() == r["output_ids"]  # each token is the keyed draw from the target's distribution
        assert r["finished"] == (r["output_ids"][-1] in tok.stop_ids)
    greedy = [r for r in a if r["temperature"] == 0.0]
    plain, _ = plain_generate(small, [r["prompt_ids"] for r in greedy], 6, 0.0, num_slots=2, warmup=False)
    assert [p.output_ids for p in plain] == [r["output_ids"] for r in greedy]


def test_resumes_by_shard_and_refuses_other_settings(small, tmp_path):
    first = run(small, tmp_path / "r", max_shards=1)
    assert first["shards"] == 1 and shard_path(tmp_path / "r", 0).exists()
    assert not shard_path(tmp_path / "r", 1).exists()
    assert list(load_responses(tmp_path / "r", shards=range(1))) == ["shard_00000"]
    with pytest.raises(ValueError, match="2 shards are asked for, but 1 are missing.*shard_00001"):
        load_responses(tmp_path / "r", shards=range(2))
    with pytest.raises(ValueError, match="asked for twice"):
        load_responses(tmp_path / "r", shards=[0, 0])
    before = shard_path(tmp_path / "r", 0).stat().st_mtime_ns
    assert run(small, tmp_path / "r")["shards"] == 2
    assert shard_path(tmp_path / "r", 0).stat().st_mtime_ns == before  # kept, not redone
    run(small, tmp_path / "once")
    assert records(tmp_path / "r") == records(tmp_path / "once")
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1", "2"] and manifest["settings"]["temperatures"] == TEMPS
    assert run(small, tmp_path / "r")["shards"] == 0  # nothing left to do
    with pytest.raises(ValueError, match="other settings.*temperatures"):
        run(small, tmp_path / "r", temperatures=[1.0])
    with pytest.raises(ValueError, match="temperatures"):
        run(small, tmp_path / "bad", temperatures=[-1.0])
    with pytest.raises(ValueError, match="num_slots"):
        run(small, tmp_path / "bad", num_slots=0)


def test_shards_store_compact_token_ids(small, tmp_path):
    run(small, tmp_path / "c")
    with np.load(shard_path(tmp_path / "c", 1)) as z:
        assert z["output_tokens"].dtype == np.uint16 and z["prompt_tokens"].dtype == np.uint16
        assert z["skipped"].tolist() == [True, False]  # prompts 2 (too long) and 3


def test_cli_refuses_dev_prompts_and_bad_samples(tmp_path, capsys):
    from train import generate_data

    with pytest.raises(SystemExit):
        generate_data.main(["--prompts", str(tmp_path / "dev" / "x.jsonl"), "--out", str(tmp_path / "o")])
    assert "dev prompts are for evaluation only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate_data.main(["--prompts", str(tmp_path), "--samples", "-1", "--out", str(tmp_path / "o")])
    assert "--samples" in capsys.readouterr().err


def test_bench_datagen_rows(small, monkeypatch, tmp_path):
    """The generator benchmark end to end on a small model (plumbing; its timings mean nothing here): both
    generators answer the same prompts, and the new one gives one answer per sample."""
    from profiling import bench_datagen

    monkeypatch.setattr(bench_datagen, "load_target", lambda model=None, dtype=None: small)
    rows = bench_datagen.main(["--prompts", "3", "--max-new-tokens", "4", "--max-prompt-tokens", "64", "--slots", "4",
                               "--old-slots", "2", "--samples", "0", "1", "--json", str(tmp_path / "b.json")])
    assert [r["answers"] for r in rows] == [3, 6]
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert json.loads((tmp_path / "b.json").read_text())["ratio"] > 0


def test_bench_attention_ways_agree():
    """The three attention layouts compute the same thing (the script checks it) and each row has its ratios."""
    from profiling import bench_attention

    rows = bench_attention.main(["--layers", "2", "--slots", "2", "--context", "16", "--repeats", "1"])
    assert rows[0]["scan_over_arrays"] > 0 and rows[0]["static_over_arrays"] > 0
