"""The engine on a device mesh: layout rules in this process; multi-device and multi-process checks in fresh
processes with simulated CPU devices (tests/mesh_checks.py), since the device count is fixed when JAX starts."""

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import pytest

from dspark_jax import sharding
from dspark_jax.models.llama import SMOLLM2_135M, LlamaConfig, init_random_weights
from dspark_jax.sharding import Axes, make_mesh, spec_for

from tests.conftest import FAST_COMPILE  # compilation dominates the checks: the suite's cheaper code generation

ROOT = Path(__file__).resolve().parents[1]


class FakeMesh:
    """What `spec_for` reads of a mesh: its axis sizes (to check the rules for meshes this process lacks)."""

    def __init__(self, data, tensor):
        self.shape = {"data": data, "tensor": tensor}


def test_rules_split_what_divides_and_replicate_the_rest():
    mesh = FakeMesh(2, 4)
    units = sharding.target_units(SMOLLM2_135M)  # 9 query heads, 3 KV heads
    assert spec_for((30, 576, 576), Axes("layers", "embed", "heads"), mesh, units=units) == jax.sharding.PartitionSpec()
    assert spec_for((30, 576, 1536), Axes("layers", "embed", "ffn"), mesh, units=units) == \
        jax.sharding.PartitionSpec(None, None, "tensor")
    assert spec_for((49152, 576), Axes("vocab", "embed"), mesh) == jax.sharding.PartitionSpec("tensor")
    assert spec_for((30, 16, 3, 64, 512), Axes("layers", "slots", "kv_heads", None, None), mesh) == \
        jax.sharding.PartitionSpec(None, "data")
    assert spec_for((30, 15, 3, 64, 512), Axes("layers", "slots", "kv_heads", None, None), mesh) == \
        jax.sharding.PartitionSpec()  # 15 slots do not divide by 2
    three = FakeMesh(1, 3)  # SmolLM2's heads divide by 3
    assert spec_for((30, 576, 576), Axes("layers", "embed", "heads"), three, units=units) == \
        jax.sharding.PartitionSpec(None, None, "tensor")
    # heads are split whole: H * E = 576 divides by 2, but 9 heads do not
    assert spec_for((576, 576), Axes("embed", "heads"), FakeMesh(1, 2), units=units) == jax.sharding.PartitionSpec()
    # one mesh axis is used once per array
    assert spec_for((8, 8), Axes("heads", "ffn"), FakeMesh(1, 2)) == jax.sharding.PartitionSpec("tensor")
    with pytest.raises(ValueError, match="logical axes"):
        spec_for((2, 3), Axes("slots"), mesh)


def test_mesh_fit_names_what_a_mesh_cannot_split():
    assert sharding.mesh_fit(SMOLLM2_135M, 16, FakeMesh(2, 3)) == []  # 9 and 3 heads, FFN, vocabulary split by 3
    problems = sharding.mesh_fit(SMOLLM2_135M, 5, FakeMesh(2, 4))
    assert len(problems) == 3, problems
    assert problems[0].startswith("5 slots do not divide by the 2 data-parallel groups")
    assert "the 9 attention heads" in problems[1] and "the 3 KV heads" in problems[2]
    assert sharding.mesh_fit(SMOLLM2_135M, 5, None) == []


def test_every_target_weight_has_declared_axes():
    cfg = LlamaConfig.tiny()
    w = init_random_weights(cfg, jax.random.key(0))
    axes = sharding.target_axes(w)
    for ax, x in zip(jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, Axes)), jax.tree.leaves(w)):
        assert len(ax.names) == x.ndim


def test_mesh_size_must_match_the_devices():
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 x --tensor-parallel-size 4 = 8 devices"):
        make_mesh(2, 4, jax.devices()[:1])
    with pytest.raises(ValueError, match="expected integers >= 1"):
        make_mesh(0, 1)
    assert sharding.mesh_shape(make_mesh(1, 1, jax.devices()[:1])) == {"data": 1, "tensor": 1}


def test_every_engine_command_takes_the_mesh_options():
    from dspark_jax.generate import build_parser

    args = build_parser().parse_args(["--prompt", "hi", "--tensor-parallel-size", "2", "--data-parallel-size", "3"])
    assert (args.tensor_parallel_size, args.data_parallel_size, args.allow_sps_mesh_mismatch) == (2, 3, False)
    with pytest.raises(ValueError, match=r"3 x --tensor-parallel-size 2 = 6 devices, but 1 are in use"):
        sharding.mesh_from_args(args)  # this process has one CPU device
    assert sharding.mesh_from_args(build_parser().parse_args(["--prompt", "hi"])) is None


def test_packaged_tables_count_as_one_device():
    from dspark_jax.build import sps_table_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no packaged table may match this host's CPU: not the point here
        table = sps_table_for("SmolLM2-135M-Instruct-Q8_0.gguf", 7)
    assert sharding.table_mesh(table) == {"data": 1, "tensor": 1}
    with pytest.raises(ValueError, match="--allow-sps-mesh-mismatch"):
        sharding.check_table_mesh(table, FakeMesh(2, 4))
    with pytest.warns(UserWarning, match="mesh"):
        sharding.check_table_mesh(table, FakeMesh(2, 4), allow_mismatch=True)
    sharding.check_table_mesh(table, None)


# ---------------------------------------------------------------------------------------------------- subprocesses


def _run(args, devices, timeout, env_extra=None):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
           "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "tests.mesh_checks", *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_engine_on_eight_devices_equals_one_device():
    """Meshes 1x8, 2x4, 4x2, 8x1: greedy dspark output equals plain decoding on one device (on 2x4 every
    policy); sampled dspark on 2x4 draws the single-device engine's samples; no compilation after warm-up;
    sampled dspark output on a 1x2 mesh follows the target's law (exact enumeration, chi-square)."""
    result = _run(["engine"], 8, timeout=900)
    policies = ("none", "fixed:2", "threshold:0.3", "dspark", "dspark-async")
    assert set(result["greedy"]) == {"1x8 dspark", "4x2 dspark", "8x1 dspark", *(f"2x4 {p}" for p in policies)}
    assert all(result["greedy"].values())
    assert result["sampled_2x4_equals_one_device"]
    assert result["compiles_after_warm_up"] == 0
    layout = result["layout_2x4"]
    assert layout["state.cache.k.0"] == "('data',)"  # 2 slots split; the 2 KV heads replicate at tensor = 4
    assert layout["weights.layers.1.wq"] == "(None, 'tensor')"  # its 4 query heads split
    assert layout["weights.layers.0.w_gate"] == "(None, 'tensor')"
    assert layout["weights.embed"] == "('tensor',)"
    assert result["law"]["chi2"] < result["law"]["critical"]


def test_paged_engine_on_eight_devices_equals_one_device():
    """The "pages" KV layout on 2x4: every policy's greedy output equals plain decoding, with prefix-cache hits
    (one index for the mesh) and no compilation after warm-up; sampled dspark draws the single-device paged
    engine's samples; greedy dspark with pages on 4x2 (the pools split over tensor); the paged attention kernel
    per device; the slot layout's prefix store refused on a mesh."""
    result = _run(["paged"], 8, timeout=900)
    policies = ("none", "fixed:2", "threshold:0.3", "dspark", "dspark-async")
    assert set(result["greedy"]) == {"4x2 pages dspark", *(f"2x4 pages {p}" for p in policies)}
    assert all(result["greedy"].values())
    assert result["pages_sampled_2x4_equals_one_device"] and result["pages_compiles_after_warm_up"] == 0
    assert result["pages_prefix_cached_tokens"] > 0  # the mesh's one prefix index served repeated prompts
    assert result["slots_prefix_cache_refused_on_mesh"]
    # the pools are replicated over data (here over tensor too: 2 KV heads at tensor = 4), the block tables split
    # with the slots; at 4x2 the pools split over tensor in whole KV heads
    pages = result["layout_2x4_pages"]
    assert pages["state.cache.pages.0"] == "()" and pages["state.dcache.k"] == "()"
    assert pages["state.cache.block_tables"] == "('data',)" and pages["state.cache.lengths"] == "('data',)"
    pages = result["layout_4x2_pages"]
    assert pages["state.cache.pages.0"] == "(None, None, 'tensor')"
    assert pages["state.dcache.k"] == "(None, None, None, 'tensor')"
    assert pages["state.cache.block_tables"] == "('data',)"
    kernel = result["pages_kernel_on_mesh"]  # the paged attention kernel per device: no collective where heads split
    assert kernel["4x2"] == {"heads_split": True, "collectives": []} and not kernel["2x4"]["heads_split"]


def test_data_parallel_rounds_move_no_cache_between_devices(tmp_path):
    """With slots split over data-parallel groups, a round over fewer requests than slots reads every slot's
    cache in place, and a prefill reads its slot by a masked sum: no collective of the round or prefill
    programs carries more than one slot's rows of a layer's cache (a gather of the active slots' caches was an
    all-reduce of every layer's rows each round; a prefill's read by index all-gathered every slot's cache)."""
    import math
    import re

    dump = tmp_path / "hlo"
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILE} --xla_dump_to={dump} "
                        f"--xla_dump_hlo_as_text"}
    result = _run(["collectives"], 2, timeout=600, env_extra=env)
    assert result["max_active"] == 2 and all(len(o) == 6 for o in result["outputs"])
    kinds = ("verify_and_commit", "draft_and_schedule", "prefill")
    programs = [f for f in dump.glob("*after_optimizations.txt") if any(k in f.name for k in kinds)]
    assert {k for f in programs for k in kinds if k in f.name} == set(kinds)
    cfg = LlamaConfig.tiny()
    one_slot = cfg.n_kv_heads * cfg.head_dim * 128  # one slot's keys of one layer at the run's capacity, 128
    moved = []
    for f in programs:
        for line in f.read_text().splitlines():
            op = re.search(r"= (.*?) (all-reduce|all-gather|all-to-all|collective-permute)\(", line)
            if not op:
                continue
            shapes = [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\[([0-9,]*)\]", op.group(1))]
            if any(128 in dims and math.prod(dims) > one_slot for dims in shapes):
                moved.append(f"{f.name}: {line.strip()[:160]}")
    assert not moved, "\n".join(moved)


def test_profile_on_a_mesh_records_it_and_other_meshes_refuse_it(tmp_path):
    result = _run(["profile", str(tmp_path / "table.json")], 8, timeout=900)
    assert result["mesh"] == {"data": 4, "tensor": 2}
    assert result["refused"] == {"1x1": True, "2x4": True}


def test_data_parallel_training_step_equals_one_device():
    result = _run(["train"], 2, timeout=600)
    assert result["max_abs_param_diff"] < 1e-5 < result["param_change"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_give_the_one_process_greedy_output(tmp_path):
    """jax.distributed over localhost: two CPU processes, one device each, a 2x1 mesh over both (the slots
    split between the processes), every process feeding the same requests: the greedy output of one."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}")
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.mesh_checks", "worker", str(i), "2", str(port),
                               str(outs[i])], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            logs.append(out[-2000:] + err[-4000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)
    results = [json.loads(o.read_text()) for o in outs]
    assert sorted(r["process"] for r in results) == [0, 1] and all(r["devices"] == 2 for r in results)
    from tests.mesh_checks import single_process_reference

    ref = single_process_reference()
    for r in results:
        assert r["outputs"]["dspark"] == ref["dspark"]
        assert r["calibrate_times"] is False  # one process's clock would steer its programs apart
