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
                       (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: not an address"),
                       (["--num-processes", "2", "--process-id", "0"], "the server runs in one process"),
                       (["--tensor-parallel-size", "0"], "argument --tensor-parallel-size")):
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


def test_quick_keeps_options_given_explicitly(refused):
    """`--quick` replaces defaults only: an option on the command line keeps its value, and a bad one is still
    refused by name."""
    import argparse

    from dspark_jax.cli import parse_with_quick
    from profiling import bench_attention, bench_datagen, bench_http

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--users", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=7)
    assert vars(parse_with_quick(p, ["--quick", "--users", "4"], users=[1], repeats=2)) == \
        {"quick": True, "users": [4], "repeats": 2}
    assert vars(parse_with_quick(p, ["--users", "4"], users=[1], repeats=2)) == \
        {"quick": False, "users": [4], "repeats": 7}
    with pytest.raises(ValueError, match="does not have: \\['slots'\\]"):
        parse_with_quick(p, ["--quick"], slots=3)
    args = parse_with_quick(bench_http.build_parser(), ["--quick", "--concurrency", "4", "8"], concurrency=[2])
    assert args.concurrency == [4, 8]
    refused(bench_http.main, ["--quick", "--repeats", "0"], "argument --repeats: expected an integer >= 1")
    refused(bench_attention.main, ["--quick", "--slots", "0"], "argument --slots")
    refused(bench_datagen.main, ["--quick", "--samples", "-1"], "argument --samples")
