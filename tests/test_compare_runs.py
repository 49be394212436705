"""train.compare_runs: the ablation table from run folders (no model needed)."""

import json

import pytest

from train import compare_runs


def make_run(folder, *, tap_norm=False, kl=0.0, lr=None, val=((100, 1.5), (200, 1.7)), params=None):
    folder.mkdir(parents=True)
    run = {"kind": "dspark", "config": {"n_layers": 2, "ffn_dim": 64, "rank": 8, "head": "markov",
                                        "draft_vocab_size": 128, "tap_norm": tap_norm, "block": 7}}
    if kl:
        run["kl"] = kl
    if lr is not None:
        run["lr"] = lr
    (folder / "run.json").write_text(json.dumps(run))
    rows = []
    for step in range(10, 210, 10):
        row = {"step": step, "seconds_per_step": 1.0 + step / 1000, "tau_prob": 1.0 + step / 1000}
        for s, tau in val:
            if s == step:
                row.update(val_loss=5.0 - tau, val_tau_prob=tau)
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if params is not None:
        (folder / "export").mkdir()
        (folder / "export" / "config.json").write_text(json.dumps({"training": {"params": params,
                                                                                 "args": {"lr": 6e-4}}}))


def test_table_compares_at_last_shared_step_and_shows_only_differing_recipe(tmp_path, capsys):
    make_run(tmp_path / "base", val=((100, 1.5), (200, 1.7)), params=2_000_000)  # lr from its export's args
    make_run(tmp_path / "norm", tap_norm=True, lr=2e-3, val=((100, 1.6), (150, 1.65)))
    out = compare_runs.main([str(tmp_path / "base"), str(tmp_path / "norm"), "--json", str(tmp_path / "a.json")])
    assert out["step"] == 100  # the last step both logged held-out metrics at
    assert [r["val_tau_prob"] for r in out["runs"]] == [1.5, 1.6]
    assert out["runs"][0]["params"] == 2_000_000 and out["runs"][1]["params"] is None
    assert out["runs"][0]["seconds_per_step"] == pytest.approx(1.055)  # median of steps 10..100
    text = capsys.readouterr().out
    assert [r["recipe"]["lr"] for r in out["runs"]] == [6e-4, 2e-3]
    assert "tap_norm" in text and "| lr |" in text and "n_layers" not in text and "kl" not in text  # what differs
    assert json.loads((tmp_path / "a.json").read_text()) == out


def test_explicit_step_and_clear_errors(tmp_path):
    make_run(tmp_path / "a", kl=1.0)
    make_run(tmp_path / "b")
    out = compare_runs.compare([compare_runs.read_run(tmp_path / x) for x in "ab"], step=200)
    assert out["runs"][0]["recipe"]["kl"] == 1.0 and out["runs"][1]["recipe"]["kl"] == 0.0
    with pytest.raises(SystemExit, match="no held-out metrics logged at step 150"):
        compare_runs.compare([compare_runs.read_run(tmp_path / "a")], step=150)
    make_run(tmp_path / "noval", val=())
    with pytest.raises(SystemExit, match="noval: no held-out metrics"):
        compare_runs.compare([compare_runs.read_run(tmp_path / "noval")])
    with pytest.raises(SystemExit, match="no run.json"):
        compare_runs.read_run(tmp_path / "missing")
