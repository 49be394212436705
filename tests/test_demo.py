"""The main job (`python -m dspark_jax.demo`) end to end on a small random target with the real tokenizer and
vocabulary and a random drafter: the script's plumbing (streamed answers, the interleaved table) is under test,
not the model."""

from __future__ import annotations

import re

import pytest


@pytest.mark.slow
def test_demo_streams_answers_and_prints_the_table(target, tmp_path, monkeypatch, capsys):
    from dspark_jax import demo
    from dspark_jax.build import load_drafter_for
    from tests.helpers import save_random_drafter, small_real_vocab_target

    small = small_real_vocab_target(target)
    drafter = save_random_drafter(small.cfg, tmp_path / "drafter", block=7)
    monkeypatch.setattr(demo, "load_target", lambda model=None, dtype=None, mesh=None: small)
    monkeypatch.setattr(demo, "load_drafter_for", lambda target, draft=None: load_drafter_for(target, drafter))

    demo.main(["--max-new-tokens", "6", "--concurrency", "1", "--rounds", "2", "--min-window-tokens", "4",
               "--repeats", "1"])
    out = capsys.readouterr().out
    # one streamed answer per shipped domain, each with its speed and accepted length
    answers = re.findall(r"^--- (\d+) tokens in [\d.]+ s \([\d.]+ tokens/s .*\), accepted length ([\d.]+)$", out, re.M)
    domains = re.findall(r"^### \[([\w-]+)\]", out, re.M)
    assert len(answers) == len(domains) == len(set(domains)) == 3
    assert all(1 <= int(n) <= 6 and float(acc) >= 1.0 for n, acc in answers)
    # the table (one load here; the streamed answers' programs serve it): every policy measured, then none,
    # the best fixed K and dspark with ratios against none
    table = out.split("closed-loop throughput", 1)[1]
    for pol in ("none", "fixed:1", "fixed:3", "fixed:7", "dspark"):
        assert re.search(rf"N=\s*1 {re.escape(pol)}\s+[\d.]+ tokens/s", table), pol
    assert "ratio_vs_none" in table
    assert len(re.findall(r"best fixed \(fixed:[137]\)", table)) == 1
    assert "wall time" in table
