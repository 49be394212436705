"""Bad command-line input is a parser error (status 2) naming the option and what it expects, before any model
loads or any work starts."""

from __future__ import annotations

import json
import sys

import pytest

from dspark_jax import build


def _no_model(*a, **k):
    raise AssertionError("the model was loaded before the bad option was refused")


@pytest.fixture
def refused(monkeypatch, capsys):
    """refused(main, argv, text): main(argv) exits with status 2 and its message contains text."""
    monkeypatch.setattr(build, "load_target", _no_model)

    def check(main, argv, text):
        module = sys.modules[main.__module__]
        if hasattr(module, "load_target"):  # the tool's own import of it
            monkeypatch.setattr(module, "load_target", _no_model)
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and text in err, err

    return check


def test_generate_and_serve(refused, tmp_path):
    from dspark_jax import generate
    from dspark_jax.serve import __main__ as serve

    (tmp_path / "bad.jsonl").write_text('{"text": "no turns"}\n')
    (tmp_path / "table.json").write_text("{}")
    for argv, text in (
            (["--prompt", "hi", "--temperature", "nan"], "argument --temperature: expected a finite number >= 0"),
            (["--prompt", "hi", "--concurrency", "0"], "expected an integer >= 1, got '0'"),
            (["--prompt", "hi", "--limit", "-1"], "argument --limit"),
            (["--prompts", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
            (["--prompts", str(tmp_path / "bad.jsonl")], 'bad.jsonl:1: expected {"turns"'),
            (["--prompt", "hi", "--json", str(tmp_path / "no" / "out.json")], "--json: cannot write"),
            (["--prompt", "hi", "--sps", str(tmp_path / "table.json")], "--sps: SPS table"),
            (["--prompt", "hi", "--draft", str(tmp_path)], f"--draft {tmp_path}: expected one of"),
            (["--prompt", "hi", "--policy", "fixed:-2"], "--policy: policy 'fixed:-2'"),
            (["--prompt", "hi", "--model", str(tmp_path / "m.gguf")], "m.gguf: no such file or folder"),
            (["--prompt", "hi", "--dtype", "int4"], "argument --dtype: invalid choice"),
    ):
        refused(generate.main, argv, text)
    for argv, text in ((["--port", "70000"], "expected a port in 0..65535"),
                       (["--api-key", " "], "--api-key: expected a non-empty key"),
                       (["--queue-timeout", "nan"], "argument --queue-timeout"),
                       (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: not an address")):
        refused(serve.main, argv, text)


def test_training_and_benchmarks(refused, tmp_path):
    from profiling import bench_round, bench_serving, profile_sps
    from train import calibrate, evaluate, summarize_eval, train_drafter

    refused(train_drafter.main, ["--run", str(tmp_path / "r"), "--lr", "0"], "argument --lr: expected a finite number > 0")
    refused(train_drafter.main, ["--run", str(tmp_path / "r"), "--init-from", str(tmp_path / "x")],
            "--init-from")
    refused(train_drafter.main, ["--run", str(tmp_path / "r"), "--cache", str(tmp_path / "none")], "build_cache")
    refused(evaluate.main, ["--draft", "dspark", "--prompts", str(tmp_path / "p.jsonl")], "neither a JSONL file")
    refused(calibrate.main, ["--draft", "dflash", "--out", str(tmp_path / "o"), "--temperatures", "-1"],
            "argument --temperatures")
    refused(bench_serving.main, ["--policies", "none", "fixed:-2"], "--policies: policy 'fixed:-2'")
    refused(bench_serving.main, ["--thresholds", "1.5"], "--thresholds: expected confidences in [0, 1]")
    refused(bench_round.main, ["--json", str(tmp_path / "no" / "r.json")], "--json: cannot write")
    refused(profile_sps.main, ["--context-lengths", "-5"], "argument --context-lengths")
    (tmp_path / "dspark_gsm8k.json").write_text("{broken")
    with pytest.raises(SystemExit, match="dspark_gsm8k.json: not valid JSON"):
        summarize_eval.main(["--dir", str(tmp_path), "--drafts", "dspark", "--domains", "gsm8k"])
    (tmp_path / "dspark_gsm8k.json").write_text(json.dumps({"rounds": 3}))
    with pytest.raises(SystemExit, match="lacks accept_len, per_position"):
        summarize_eval.main(["--dir", str(tmp_path), "--drafts", "dspark", "--domains", "gsm8k"])
