"""``generate --trace``: one JSON line per round and request, consistent with what the engine emitted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax import generate
from tests.test_engine import SPS, make_drafter, make_model, prompts


def test_trace_records_every_round_and_request(tmp_path):
    model = make_model()
    drafter = make_drafter(model)
    from dspark_jax import engine as eng

    # test_engine's engine shapes: its compiled programs are read back from the run's compilation cache
    e = eng.Engine(model, drafter, "fixed:3", eng.EngineConfig(num_slots=3, capacity=64), sps=SPS, stop_ids=[5])
    ps = prompts(4, seed=5)
    path = tmp_path / "trace.jsonl"
    out = generate.run_traced(e, ps, 9, path)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == sum(r.active for r in e.rounds)
    assert sorted({r["round"] for r in rows}) == list(range(len(e.rounds)))
    G = drafter.cfg.block
    for r in rows:
        assert len(r["drafted"]) == len(r["confidences"]) == len(r["confidence_logits"]) == G
        assert all(0.0 <= c <= 1.0 for c in r["confidences"])
        assert r["scheduled"] <= 3 and 0 <= r["accepted"] <= r["scheduled"]
        # the accepted drafts are the first emitted tokens; the round emits them plus one (unless the budget ends)
        k = min(r["accepted"], len(r["emitted"]))  # a stop token among the accepted drafts ends the request
        assert r["emitted"][:k] == r["drafted"][:k]
        assert len(r["emitted"]) <= r["accepted"] + 1
    for rid, c in enumerate(out):
        emitted = [t for r in sorted(rows, key=lambda r: r["round"]) if r["request"] == rid for t in r["emitted"]]
        assert [c.output_ids[0]] + emitted == c.output_ids  # the first token comes from admission
    assert any(r["accepted"] > 0 for r in rows) and any(r["accepted"] < r["scheduled"] for r in rows)
    np.testing.assert_allclose([r["confidences"] for r in rows],
                               [list(x) for s in e.rounds for x in np.round(s.confidences, 6)], atol=1e-6)


def test_trace_path_is_checked_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(generate, "load_target", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit):
        generate.main(["--prompt", "x", "--trace", str(tmp_path / "missing" / "t.jsonl")])
