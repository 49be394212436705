"""train.pipeline: the stages' order and arguments, resuming after an interruption, refusing other settings.

The stages' own commands are tested in their own files; here they are stand-ins that record their calls.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from dspark_jax.io import check_writable
from train import pipeline


class Interrupted(Exception):
    pass


def fake_mains(calls, fail_on=None):
    """Stand-ins for the stages' entry points; ``fail_on``: raise once in the command with that label."""
    failed = set()

    def make(name):
        def main(argv):
            calls.append((name, list(argv)))
            if name == fail_on and name not in failed:
                failed.add(name)
                raise Interrupted(name)
            if name == "generate_data":  # the data folder's manifest: 64 prompts in shards of 32
                out = Path(argv[argv.index("--out") + 1])
                out.mkdir(parents=True, exist_ok=True)
                (out / "manifest.json").write_text(json.dumps({"settings": {"prompts": 64, "shard_prompts": 32}}))
            if "--json" in argv:  # evaluate and summarize_eval write their report, into a folder that exists
                path = Path(argv[argv.index("--json") + 1])
                check_writable(path)
                path.write_text("{}")
        return main

    return {n: make(n) for n in pipeline.COMMANDS}


def dev_prompts(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for d in pipeline.DOMAINS:
        (dev / f"{d}.jsonl").write_text('{"turns": ["hi"]}\n')
    return dev


def args_for(tmp_path, *extra):
    dev = tmp_path / "dev" if (tmp_path / "dev").exists() else dev_prompts(tmp_path)
    p = pipeline.build_parser()
    args = p.parse_args(["--out", str(tmp_path / "run"), "--data", str(tmp_path / "data"), "--dev-prompts", str(dev),
                         "--train-prompts", str(tmp_path), *extra])
    pipeline.check_inputs(args, p)
    return args


def test_stages_run_in_order_with_the_same_recipe_for_both_drafters(tmp_path):
    calls = []
    record = pipeline.run(args_for(tmp_path, "--steps", "30", "--kl", "0.5", "--tap-norm", "--lr", "0.002",
                                   "--init-layers", "-2", "-1"),
                          fake_mains(calls),
                          log=lambda m: None)
    names = [c[0] for c in calls]
    assert names[:6] == ["generate_data", "build_cache", "build_cache", "train_drafter", "train_drafter", "calibrate"]
    n_eval = len(pipeline.TEMPERATURES) * len(pipeline.DRAFTERS) * len(pipeline.DOMAINS)
    assert names[6:] == ["evaluate"] * n_eval + ["summarize_eval"] * len(pipeline.TEMPERATURES)
    train_cache, val_cache = calls[1][1], calls[2][1]  # every shard of the manifest's 2, the last held out
    assert train_cache[train_cache.index("--shards") + 1] == "0:1" and val_cache[val_cache.index("--shards") + 1] == "1:2"
    dspark, dflash = calls[3][1], calls[4][1]
    assert dspark[dspark.index("--val-cache") + 1].endswith("val_cache")
    strip = lambda a: [x for x in a if x not in ("dspark", "dflash") and not x.endswith(("/dspark", "/dflash"))]
    assert strip(dspark) == strip(dflash)  # same data, steps, seed and recipe options
    assert dspark[dspark.index("--steps") + 1] == "30" and "--tap-norm" in dspark and "--kl" in dspark
    assert dspark[dspark.index("--lr") + 1] == "0.002" and "--context-tokens" not in dspark  # unset: its default
    i = dspark.index("--init-layers")
    assert dspark[i + 1:i + 3] == ["-2", "-1"] and record["settings"]["init_layers"] == [-2, -1]
    evals = [c[1] for c in calls if c[0] == "evaluate"]
    assert all(a[a.index("--half") + 1] == "eval" for a in evals)  # the held-out half only
    assert {a[a.index("--temperature") + 1] for a in evals} == {"0", "1"}
    assert all(st["finished"] for st in record["stages"].values()) and record["total_seconds"] >= 0


def test_an_interrupted_run_resumes_at_its_stage(tmp_path):
    args = args_for(tmp_path)
    calls = []
    with pytest.raises(Interrupted):
        pipeline.run(args, fake_mains(calls, fail_on="evaluate"), log=lambda m: None)
    stages = json.loads((Path(args.out) / pipeline.RECORD).read_text())["stages"]
    assert stages["train-dflash"]["finished"] and not stages["eval"]["finished"]
    calls2 = []
    pipeline.run(args, fake_mains(calls2), log=lambda m: None)
    names = [c[0] for c in calls2]
    assert "train_drafter" not in names and "build_cache" not in names  # finished stages are skipped
    # the failed evaluation runs again; the reports already written are not
    n_eval = len(pipeline.TEMPERATURES) * len(pipeline.DRAFTERS) * len(pipeline.DOMAINS)
    assert names.count("evaluate") == n_eval
    calls3 = []
    pipeline.run(args, fake_mains(calls3), log=lambda m: None)
    assert calls3 == []  # everything finished


def test_sigterm_unwinds_and_records_the_stage_time(tmp_path):
    args = args_for(tmp_path)
    mains = fake_mains([])

    def slow_cache(argv):  # killed half a second into the cache stage
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the handler raises in this frame
        raise AssertionError("SIGTERM did not interrupt the stage")

    mains["build_cache"] = slow_cache
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
        pipeline.exit_on_sigterm()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(SystemExit) as e:
            pipeline.run(args, mains, log=lambda m: None)
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    assert e.value.code == 128 + signal.SIGTERM
    stages = json.loads((Path(args.out) / pipeline.RECORD).read_text())["stages"]
    assert not stages["cache"]["finished"] and stages["cache"]["seconds"] >= 0.5


def test_eval_reports_on_disk_are_not_recomputed(tmp_path):
    args = args_for(tmp_path)
    calls = []
    with pytest.raises(Interrupted):  # every evaluation wrote its report, then the summary stopped the run
        pipeline.run(args, fake_mains(calls, fail_on="summarize_eval"), log=lambda m: None)
    calls2 = []
    pipeline.run(args, fake_mains(calls2), log=lambda m: None)
    assert [c[0] for c in calls2] == ["summarize_eval"] * len(pipeline.TEMPERATURES)


def test_other_settings_in_the_same_folder_are_refused(tmp_path):
    pipeline.run(args_for(tmp_path, "--steps", "10"), fake_mains([]), log=lambda m: None)
    with pytest.raises(SystemExit, match="steps"):
        pipeline.run(args_for(tmp_path, "--steps", "20"), fake_mains([]), log=lambda m: None)


def test_shards_limit_generates_only_what_is_missing(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for k in range(3):
        (data / f"shard_{k:05d}.npz").write_bytes(b"")
    calls = []
    pipeline.run(args_for(tmp_path, "--shards", "5"), fake_mains(calls), log=lambda m: None)
    gen = dict(calls)["generate_data"]
    assert gen[gen.index("--max-shards") + 1] == "2"
    caches = [argv for name, argv in calls if name == "build_cache"]
    assert [a[a.index("--shards") + 1] for a in caches] == ["0:4", "4:5"]


@pytest.mark.parametrize("extra,match", [(["--steps", "0"], "--steps 0"), (["--shards", "0"], "--shards 0"),
                                         (["--kl", "-1"], "--kl -1"), (["--shards", "2", "--val-shards", "2"],
                                                                       "--val-shards 2"),
                                         (["--lr", "0"], "--lr 0"), (["--context-tokens", "0"], "--context-tokens 0"),
                                         (["--init-layers", "-1"], "--init-layers -1: expected one target layer per "
                                                                   "drafter layer (2)"),
                                         (["--layers", "3", "--init-layers", "-2", "-1"],
                                          "--init-layers -2 -1: expected one target layer per drafter layer (3)")])
def test_bad_options_are_refused_before_work(tmp_path, extra, match, capsys):
    with pytest.raises(SystemExit):
        args_for(tmp_path, *extra)
    assert match in capsys.readouterr().err


def test_missing_dev_prompts_are_named(tmp_path, capsys):
    p = pipeline.build_parser()
    args = p.parse_args(["--out", str(tmp_path / "run"), "--dev-prompts", str(tmp_path / "nodev"),
                         "--train-prompts", str(tmp_path)])
    with pytest.raises(SystemExit):
        pipeline.check_inputs(args, p)
    assert "gsm8k.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("value,match", [("5", "is not START:STOP"), ("4:2", "0 <= START < STOP"),
                                         ("0:3,5", "'5' is not START:STOP"), ("0:3,2:4", "overlap")])
def test_build_cache_refuses_a_bad_shard_range(value, match, capsys, tmp_path):
    from train import build_cache

    with pytest.raises(SystemExit):
        build_cache.main(["--data", str(tmp_path), "--out", str(tmp_path / "c"), "--shards", value])
    assert match in capsys.readouterr().err


def test_commands_run_in_their_own_process(tmp_path, monkeypatch):
    """A stage command is a child process in a group of its own: its status reaches the pipeline, and an
    interrupted wait hands the child SIGINT, so that it unwinds (its ``finally`` runs) before the pipeline
    stops."""
    (tmp_path / "sleeper.py").write_text(
        "import os, sys, time\n"
        "try:\n"
        "    open(sys.argv[1] + '.group', 'w').write(str(os.getpgid(0)))\n"
        "    open(sys.argv[1] + '.started', 'w').close()\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    open(sys.argv[1], 'w').write('unwound')\n")
    (tmp_path / "failer.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with pytest.raises(SystemExit, match="failer --x: exited with status 3"):
        pipeline.command_in_process("failer")(["--x"])
    marker = tmp_path / "marker"

    old = signal.getsignal(signal.SIGALRM)
    try:
        main = pipeline.command_in_process("sleeper", grace_seconds=30)
        deadline = time.monotonic() + 30

        def arm_when_started(signum, frame):  # interrupt only once the child runs its try block
            if (tmp_path / "marker.started").exists() or time.monotonic() > deadline:
                raise KeyboardInterrupt
            signal.setitimer(signal.ITIMER_REAL, 0.1)

        signal.signal(signal.SIGALRM, arm_when_started)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            main([str(marker)])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert marker.read_text() == "unwound"
    # its own process group: a terminal's Ctrl-C reaches it only through the pipeline, once
    assert int((tmp_path / "marker.group").read_text()) != os.getpgid(0)
