"""Acceptance statistics of recorded rounds, and the evaluation path through the engine (tiny model)."""

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax import evaluation
from dspark_jax.models import drafter as dr
from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights


def test_acceptance_report_by_hand():
    accepted = np.array([0, 2, 3, 3, 1])
    verified = np.array([3, 3, 3, 3, 2])
    rep = evaluation.acceptance_report(accepted, verified, 3)
    assert rep["accept_len"] == np.mean(accepted + 1) and rep["rounds"] == 5
    s1, s2, s3 = (p["survival"] for p in rep["per_position"])
    assert s1 == 4 / 5 and s2 == 3 / 5 and s3 == 2 / 4  # position 3 is seen by the four rounds that verified 3
    c2 = rep["per_position"][1]["conditional"]
    assert c2 == 3 / 4  # of the rounds that accepted >= 1 and verified >= 2


def test_split_half():
    items = list(range(7))
    assert evaluation.split_half(items, "calib") == [0, 2, 4, 6]
    assert evaluation.split_half(items, "eval") == [1, 3, 5]


def test_fixed_block_rounds_record_everything():
    cfg = LlamaConfig.tiny()
    model = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0), scale=0.3), None)
    d = dr.Drafter(dr.DrafterConfig.for_target(cfg, n_layers=1, ffn_dim=16, rank=4, block=3), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=6).tolist() for _ in range(4)]
    rounds, _ = evaluation.fixed_block_rounds(model, d, prompts, max_new_tokens=10, temperature=1.0, concurrency=2)
    rep = evaluation.evaluate_rounds(rounds, 3, np.ones(3))
    assert rep["rounds"] == sum(r.active for r in rounds)
    assert all(r.confidence_logits.shape == (r.active, 3) for r in rounds)
    assert 1.0 <= rep["accept_len"] <= 4.0 and rep["ece_sts"] is not None


def test_summary_pools_ece_exactly_from_bins():
    """The README table's pooled ECE (merged reliability bins of per-domain reports) equals the ECE of the
    union of their rounds."""
    from dspark_jax import calibration
    from train.summarize_eval import pool

    rng = np.random.default_rng(3)
    parts = []
    for n, skew in ((500, 0.8), (1500, 1.3)):
        pred = rng.uniform(size=n)
        outcome = rng.uniform(size=n) < pred**skew
        parts.append((pred, outcome))
    reports = [{"rounds": len(p), "accept_len": 1.5, "auroc": 0.8, "per_position": [{"auroc_raw": 0.7}],
                "reliability_raw": calibration.reliability_bins(p, o), "reliability_sts": None} for p, o in parts]
    union = np.concatenate([p for p, _ in parts]), np.concatenate([o for _, o in parts])
    got = pool(reports)
    assert got["ece_raw"] == pytest.approx(float(calibration.ece(*union)), abs=1e-6)
    assert got["ece_sts"] is None and got["rounds"] == 2000


def test_half_per_file_limits_each_file_of_a_folder(tmp_path):
    """A folder of prompt files gives each file its own half and limit (a limit over the folder's joined list
    would evaluate only its first file)."""
    for name, n in (("a", 6), ("b", 5)):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"turns": ["{name}{i}"]}}\n' for i in range(n)))
    (tmp_path / "notes.txt").write_text("not a prompt file")
    chosen = evaluation.half_per_file([tmp_path], "eval", limit=2)
    assert [[p.turns[0] for p in c] for c in chosen] == [["a1", "a3"], ["b1", "b3"]]
    chosen = evaluation.half_per_file([tmp_path / "b.jsonl", tmp_path], "calib")
    assert [[p.turns[0] for p in c] for c in chosen] == [["b0", "b2", "b4"], ["a0", "a2", "a4"], ["b0", "b2", "b4"]]
    with pytest.raises(ValueError, match="neither a JSONL file nor a folder"):
        evaluation.half_per_file([tmp_path / "missing"], "eval")
    with pytest.raises(ValueError, match="half: expected"):
        evaluation.half_per_file([tmp_path], "odd")


def test_per_request_rows_cover_every_round_and_match_a_smaller_limit():
    """Each request's rows sum to the report's rounds; the first prompts of a run over more prompts are decoded
    with the same draws as a run over them alone (sampling is keyed by request), so `summarize_eval --first`
    compares runs at different limits."""
    cfg = LlamaConfig.tiny()
    model = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0), scale=0.3), None)
    d = dr.Drafter(dr.DrafterConfig.for_target(cfg, n_layers=1, ffn_dim=16, rank=4, block=3), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, size=6).tolist() for _ in range(4)]
    small, _ = evaluation.fixed_block_rounds(model, d, prompts[:2], max_new_tokens=12, temperature=1.0, concurrency=2)
    large, _ = evaluation.fixed_block_rounds(model, d, prompts, max_new_tokens=12, temperature=1.0, concurrency=2)
    rep = evaluation.evaluate_rounds(large, 3, labels=[[0, i] for i in range(4)])
    rows = rep["per_request"]
    assert [r["request"] for r in rows] == [0, 1, 2, 3] and [r["prompt"] for r in rows] == [[0, i] for i in range(4)]
    assert sum(r["rounds"] for r in rows) == rep["rounds"]
    assert 1 + sum(r["accepted"] for r in rows) / rep["rounds"] == pytest.approx(rep["accept_len"])
    assert evaluation.per_request(small) == [{k: v for k, v in r.items() if k != "prompt"} for r in rows[:2]]


def test_encode_chosen_labels_kept_prompts_by_position():
    from dspark_jax.data import Prompt

    class Tok:
        def encode_chat(self, turns):
            return list(range(len(turns[0])))

    chosen = [[Prompt(i, "p", (t,)) for i, t in enumerate(("ab", "abcdef", "abc"))], [Prompt(0, "q", ("a",))]]
    kept = evaluation.encode_chosen(Tok(), chosen, max_prompt_tokens=4)
    assert [(f, i) for f, i, _ in kept] == [(0, 0), (0, 2), (1, 0)]  # the long prompt dropped, positions kept
    assert evaluation.encode_first_turns(Tok(), chosen, 4) == [[0, 1], [0, 1, 2], [0]]
    with pytest.raises(ValueError, match="--max-prompt-tokens 0"):
        evaluation.encode_chosen(Tok(), chosen, max_prompt_tokens=0)


def _report(rows):
    n = sum(r["rounds"] for r in rows)
    return {"rounds": n, "accept_len": 1 + sum(r["accepted"] for r in rows) / n, "auroc": 0.8,
            "ece_raw": 0.1, "ece_sts": None, "per_position": [{"auroc_raw": 0.7}],
            "reliability_raw": None, "per_request": rows}


def test_summary_cuts_to_first_prompts_and_gives_intervals(tmp_path):
    import json

    from train import summarize_eval

    def rows(acc):  # one request per prompt, 10 rounds each, accepted drafts in total
        return [{"request": i, "rounds": 10, "accepted": a, "prompt": [0, i]} for i, a in enumerate(acc)]

    reports = {("a", "x"): rows([5, 10, 15, 40]), ("b", "x"): rows([10, 20, 30, 0]),
               ("a", "y"): rows([0, 10, 20]), ("b", "y"): rows([0, 20, 40])}
    for (d, dom), r in reports.items():
        (tmp_path / f"{d}_{dom}.json").write_text(json.dumps(_report(r)))
    argv = ["--dir", str(tmp_path), "--drafts", "a", "b", "--domains", "x", "y"]
    full = summarize_eval.main(argv)
    assert full["pooled"]["a"]["accept_len"] == pytest.approx(1 + 100 / 70)
    lo, hi = full["pooled"]["ratio_interval"]
    assert lo <= full["pooled"]["b"]["accept_len"] / full["pooled"]["a"]["accept_len"] <= hi and lo < hi
    cut = summarize_eval.main(argv + ["--first", "2"])  # prompts 0 and 1 of each file
    assert cut["x"]["a"]["accept_len"] == pytest.approx(1 + 15 / 20) and cut["x"]["b"]["rounds"] == 20
    assert cut["pooled"]["b"]["accept_len"] == pytest.approx(1 + 50 / 40)
    assert cut["pooled"]["a"]["ece_raw"] is None  # calibration is not kept per prompt
    same = summarize_eval.main(["--dir", str(tmp_path), "--drafts", "a", "a", "--domains", "x", "y"])
    assert same["pooled"]["ratio_interval"] == [1.0, 1.0]  # paired: the same prompts redrawn for both
    old = _report(rows([1, 2]))
    del old["per_request"]
    (tmp_path / "a_x.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="per-prompt rows"):
        summarize_eval.main(argv + ["--first", "2"])
    assert "ratio_interval" not in summarize_eval.main(argv)["pooled"]  # older reports: no intervals


def test_evaluate_refuses_an_unwritable_report_before_decoding(tmp_path, capsys):
    from train import evaluate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    with pytest.raises(SystemExit):
        evaluate.main(["--prompts", str(prompts), "--json", str(tmp_path / "missing" / "r.json")])
    err = capsys.readouterr().err
    assert "--json: cannot write" in err and "missing does not exist" in err
