"""Checks that need several devices, run by tests/test_sharding.py in a fresh process (the simulated device
count must be set before JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.mesh_checks engine
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.mesh_checks paged
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.mesh_checks profile OUT.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.mesh_checks train
    python -m tests.mesh_checks worker PROCESS_ID NUM_PROCESSES PORT OUT.json   # one process of a multi-process run

Each prints one JSON line (``RESULT {...}``) that the test reads; a failed check raises.
"""

from __future__ import annotations

import json
import sys

MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))  # data x tensor
GREEDY_POLICIES = ("none", "fixed:2", "dspark")


def tiny_target_and_drafter(vocab: int = 64, scale: float = 0.3, seed: int = 0, block: int = 3):
    """The engine tests' tiny random target (4 query heads, 2 KV heads, FFN 64: at tensor = 2 everything
    splits, at 4 the KV heads replicate, at 8 both head counts do) and a one-layer drafter."""
    import jax
    from flax import nnx

    from dspark_jax.models import drafter as dr
    from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights

    cfg = LlamaConfig.tiny(vocab_size=vocab)
    model = LlamaModel(cfg, init_random_weights(cfg, jax.random.key(seed), scale=scale), None)
    dcfg = dr.DrafterConfig.for_target(cfg, n_layers=1, ffn_dim=32, rank=8, block=block)
    d = dr.Drafter(dcfg, rngs=nnx.Rngs(seed))
    d.w2.kernel[...] = 0.5 * jax.random.normal(jax.random.key(seed + 3), d.w2.kernel[...].shape)
    return model, d


def prompts(n: int, seed: int = 0, vocab: int = 64) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=rng.integers(2, 14)).tolist() for _ in range(n)]


def run_engine(model, d, policy, ps, budgets, *, mesh=None, temperature=0.0, slots=8, warm=False,
               calibrate_times=False, **config):
    """Outputs of an engine run (and the compilations after its warm-up, with ``warm``); ``calibrate_times``:
    the gate's (`GateConfig`); ``config``: other `EngineConfig` fields (the KV layout)."""
    import numpy as np

    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.gate import GateConfig
    from dspark_jax.timing import compile_count

    sps = np.linspace(10.0, 1.0, 48).astype(np.float32)
    e = Engine(model, d, policy, EngineConfig(num_slots=slots, capacity=64, temperature=temperature, seed=3,
                                              gate=GateConfig(calibrate_times=calibrate_times), **config),
               sps=sps, stop_ids=[5], mesh=mesh)
    if warm:
        e.warm_up(max_prompt_tokens=max(len(p) for p in ps))
    before = compile_count()
    ids = [e.submit(p, b) for p, b in zip(ps, budgets)]
    while not e.idle():
        e.step()
    return [e.requests[i].output_ids for i in ids], compile_count() - before, e


def check_engine() -> dict:
    """Greedy output equals plain decoding on one device (what every policy's greedy output is): dspark on
    every mesh, every other policy as well on 2x4; sampled dspark on 2x4 draws the single-device engine's
    samples; no compilation after warm-up; the layout splits what divides. (The "pages" KV layout: `check_paged`;
    the law on a mesh: `check_law`.)"""
    import jax

    from dspark_jax.sharding import layout_report, make_mesh

    assert jax.device_count() == 8, jax.devices()
    model, d = tiny_target_and_drafter()
    ps, budgets = prompts(2, seed=5), [6, 3]  # requests leave at different rounds
    ps2, budgets2 = prompts(5, seed=6), [4, 7, 2, 5, 3]  # on two slots: joins and leaves
    ref = run_engine(model, d, "none", ps, budgets)[0]
    ref2 = run_engine(model, d, "none", ps2, budgets2, slots=2)[0]
    log("single-device references")
    out = {"greedy": {}}
    mesh = make_mesh(2, 4)
    # 2x4, two slots: warm-up compiles every shape, then the run compiles nothing; the other policies share
    # most of its programs.
    got, compiles, e = run_engine(model, d, "dspark", ps2, budgets2, mesh=mesh, slots=2, warm=True)
    assert got == ref2, ("2x4 dspark", got, ref2)
    assert compiles == 0, compiles
    assert len({r.active for r in e.rounds}) > 1
    out["compiles_after_warm_up"] = compiles
    out["greedy"]["2x4 dspark"] = True
    out["layout_2x4"] = layout_report({"state": e.state, "weights": e.target.weights, "drafter": e.d_state})
    log("2x4 dspark greedy after warm-up ok")
    for pol in ("none", "fixed:2", "threshold:0.3", "dspark-async"):
        got = run_engine(model, d, pol, ps2, budgets2, mesh=mesh, slots=2)[0]
        assert got == ref2, ("2x4", pol, got, ref2)
        out["greedy"][f"2x4 {pol}"] = True
        log(f"2x4 {pol} greedy ok")
    # Sampled: the per-request keys do not depend on the layout, so the 2x4 engine draws the single-device
    # engine's very samples (the law itself is checked by `check_law` and on one device by test_engine).
    one = run_engine(model, d, "dspark", ps2, budgets2, slots=2, temperature=1.0)[0]
    got = run_engine(model, d, "dspark", ps2, budgets2, mesh=mesh, slots=2, temperature=1.0)[0]
    assert got == one, ("2x4 sampled dspark", got, one)
    out["sampled_2x4_equals_one_device"] = True
    log("2x4 dspark sampled equals one device")
    for data, tensor in ((1, 8), (4, 2), (8, 1)):  # eight slots: split over data everywhere
        got = run_engine(model, d, "dspark", ps, budgets, mesh=make_mesh(data, tensor))[0]
        assert got == ref, (f"{data}x{tensor}", got, ref)
        out["greedy"][f"{data}x{tensor} dspark"] = True
        log(f"{data}x{tensor} dspark greedy ok")
    return out


def check_paged() -> dict:
    """`check_engine`'s workloads and single-device references on the "pages" layout (`check_paged_engine`), in a
    process of its own (the two run side by side in the suite)."""
    import jax

    assert jax.device_count() == 8, jax.devices()
    model, d = tiny_target_and_drafter()
    ps, budgets = prompts(2, seed=5), [6, 3]
    ps2, budgets2 = prompts(5, seed=6), [4, 7, 2, 5, 3]
    ref = run_engine(model, d, "none", ps, budgets)[0]
    ref2 = run_engine(model, d, "none", ps2, budgets2, slots=2)[0]
    log("single-device references")
    return check_paged_engine(model, d, ps, budgets, ref, ps2, budgets2, ref2)


# The paged layout's checks: pages of 4 tokens, so the prompts (2 to 13 tokens) and answers cross page boundaries.
PAGED = {"kv_layout": "pages", "block_size": 4}


def check_paged_engine(model, d, ps, budgets, ref, ps2, budgets2, ref2) -> dict:
    """The "pages" KV layout on a mesh (`check_engine`'s workloads and references): on 2x4 (slots and block
    tables over data, the pool replicated over data; the tiny target's 2 KV heads replicate at tensor = 4) greedy
    dspark after warm-up equals plain decoding with no compilation, every other policy too, and sampled dspark
    draws the single-device paged engine's samples; the workload repeats two prompts, so later requests take
    earlier ones' pages from the prefix cache (on by default with pages, one index for the mesh). On 4x2 the
    pools split over tensor (2 KV heads at tensor = 2) and greedy dspark equals plain decoding. (The CPU runs the
    XLA path; the GPU / TPU kernels on a mesh: `check_kernel_on_mesh`.)"""
    from dspark_jax.sharding import layout_report, make_mesh

    out = {"greedy": {}}
    mesh = make_mesh(2, 4)
    ps_p, budgets_p, ref_p = ps2 + [ps2[3], ps2[0]], budgets2 + [budgets2[3], budgets2[0]], ref2 + [ref2[3], ref2[0]]
    got, compiles, e = run_engine(model, d, "dspark", ps_p, budgets_p, mesh=mesh, slots=2, warm=True, **PAGED)
    assert e.kv_layout == "pages" and e.prefix_caching
    assert got == ref_p, ("2x4 pages dspark", got, ref_p)
    assert compiles == 0, compiles
    out["pages_compiles_after_warm_up"] = compiles
    out["pages_prefix_cached_tokens"] = e.prefix_cache_stats()["cached_tokens"]
    assert out["pages_prefix_cached_tokens"] > 0, e.prefix_cache_stats()
    out["greedy"]["2x4 pages dspark"] = True
    out["layout_2x4_pages"] = layout_report({"state": e.state})
    log("2x4 pages dspark greedy after warm-up ok")
    for pol in ("none", "fixed:2", "threshold:0.3", "dspark-async"):
        got = run_engine(model, d, pol, ps_p, budgets_p, mesh=mesh, slots=2, **PAGED)[0]
        assert got == ref_p, ("2x4 pages", pol, got, ref_p)
        out["greedy"][f"2x4 pages {pol}"] = True
        log(f"2x4 pages {pol} greedy ok")
    one = run_engine(model, d, "dspark", ps_p, budgets_p, slots=2, temperature=1.0, **PAGED)[0]
    got = run_engine(model, d, "dspark", ps_p, budgets_p, mesh=mesh, slots=2, temperature=1.0, **PAGED)[0]
    assert got == one, ("2x4 pages sampled dspark", got, one)
    out["pages_sampled_2x4_equals_one_device"] = True
    log("2x4 pages dspark sampled equals one device")
    got, _, e = run_engine(model, d, "dspark", ps, budgets, mesh=make_mesh(4, 2), **PAGED)
    assert got == ref, ("4x2 pages", got, ref)
    out["greedy"]["4x2 pages dspark"] = True
    out["layout_4x2_pages"] = layout_report({"state": e.state})
    log("4x2 pages dspark greedy ok")
    out["pages_kernel_on_mesh"] = check_kernel_on_mesh()
    log("paged attention kernel per device ok")
    from dspark_jax.engine import Engine, EngineConfig

    try:  # the slot layout's prefix store is not laid out on a mesh: required, it is refused
        Engine(model, None, "none", EngineConfig(num_slots=2, capacity=64, kv_layout="slots",
                                                 enable_prefix_caching=True), mesh=mesh)
        out["slots_prefix_cache_refused_on_mesh"] = False
    except ValueError as err:
        assert "kv_layout 'pages'" in str(err), err
        out["slots_prefix_cache_refused_on_mesh"] = True
    return out


def check_kernel_on_mesh() -> dict:
    """The Pallas GPU kernel (interpret mode: the kernel path the engine takes on a GPU, which XLA cannot
    partition) under a current mesh runs per device (`kernels.per_device`): on 4x2 each device attends with its
    own KV heads over its share of the pool, no collective in the program; on 2x4 (2 KV heads do not divide by
    4) every device attends with every head. Both equal the kernel on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dspark_jax import kernels
    from dspark_jax.sharding import make_mesh

    rng = np.random.default_rng(0)
    T, H, K, E, pool, ps = 8, 4, 2, 8, 12, 4
    q = jnp.asarray(rng.normal(size=(T, H, E)), jnp.float32)
    pages = jnp.asarray(rng.normal(size=(pool, ps, 2 * K, E)), jnp.float32)
    meta = (jnp.array([5, 9, 3], jnp.int32), jnp.asarray(rng.permutation(pool).reshape(3, 4), jnp.int32),
            jnp.array([0, 2, 5, 6], jnp.int32), jnp.array([3], jnp.int32))
    attend = jax.jit(lambda *a: kernels.ragged_paged_attention(*a, max_q_per_seq=3, impl="gpu", interpret=True,
                                                               head_axis="tensor"))
    want = np.asarray(attend(q, pages, *meta))
    out = {}
    for data, tensor in ((4, 2), (2, 4)):
        mesh = make_mesh(data, tensor)
        split = K % tensor == 0
        args = (jax.device_put(q, NamedSharding(mesh, P(None, "tensor"))),
                jax.device_put(pages, NamedSharding(mesh, P(None, None, "tensor") if split else P())), *meta)
        with jax.set_mesh(mesh):
            got = attend(*args)
            hlo = attend.lower(*args).compile().as_text()
        np.testing.assert_array_equal(np.asarray(got), want)
        collectives = [op for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute") if op in hlo]
        assert not split or not collectives, collectives
        out[f"{data}x{tensor}"] = {"heads_split": split, "collectives": collectives}
    return out


def log(msg: str) -> None:
    import time

    print(f"[{time.process_time():.0f} s cpu] {msg}", file=sys.stderr, flush=True)


def check_law() -> dict:
    """Sampled output on a 1x2 mesh (two of the devices: cheaper to dispatch 1000 small programs on) follows
    the target's law (chi-square against exact enumeration of the first three tokens; cells expected below 5
    pooled)."""
    import jax

    import itertools

    import numpy as np

    from dspark_jax.sharding import make_mesh

    model, d = tiny_target_and_drafter(vocab=4, scale=0.15, seed=1, block=2)
    prompt, m, n_req = [1, 2, 3, 1], 3, 360
    probs = {}
    for n in range(m):
        for prefix in itertools.product(range(4), repeat=n):
            logits = np.asarray(model.score(prompt + list(prefix)))[-1]
            p = np.exp(logits - logits.max())
            probs[prefix] = p / p.sum()
    law = np.zeros((4,) * m)
    for z in itertools.product(range(4), repeat=m):
        law[z] = np.prod([probs[z[:i]][z[i]] for i in range(m)])
    got, _, e = run_engine(model, d, "dspark", [prompt] * n_req, [m] * n_req,
                           mesh=make_mesh(1, 2, jax.devices()[:2]), temperature=1.0, slots=16)
    counts = np.zeros_like(law)
    for o in got:
        counts[tuple(o)] += 1
    expected = law * n_req
    big = expected >= 5
    chi2 = float((((counts - expected) ** 2)[big] / expected[big]).sum())
    small_obs, small_exp = counts[~big].sum(), expected[~big].sum()
    if small_exp > 0:
        chi2 += float((small_obs - small_exp) ** 2 / small_exp)
    dof = int(big.sum()) + int(small_exp > 0) - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3  # p = 0.001
    assert chi2 < crit, (chi2, crit, dof)
    assert e.summary()["drafts_per_request"] > 0
    log("law ok")
    return {"chi2": chi2, "critical": float(crit), "dof": dof}


def check_profile(out: str) -> dict:
    """profile_sps on a 4x2 mesh writes a valid table recording the mesh; an engine on another mesh (or
    on one device) refuses it unless told otherwise."""
    import warnings

    from dspark_jax.build import build_engine
    from dspark_jax.sharding import make_mesh, table_mesh
    from dspark_jax.sps import SPSTable
    from profiling import profile_sps

    table = profile_sps.main(["--tiny", "--quick", "--max-tokens", "16", "--context-lengths", "120", "--repeats",
                              "1", "--no-host-speed", "--no-plot", "--no-overhead", "--tensor-parallel-size", "2",
                              "--data-parallel-size", "4", "--out", out])
    loaded = SPSTable.load(out)
    assert loaded == table and table_mesh(loaded) == {"data": 4, "tensor": 2}, loaded.metadata.extra
    assert loaded.metadata.extra["device_count"] == 8
    model, d = tiny_target_and_drafter(block=profile_sps.measure.DEFAULT_BLOCK)
    from dspark_jax.build import LoadedDrafter

    loaded_d = LoadedDrafter(d, None, 0.7, None)
    refused = {}
    for mesh in (None, make_mesh(2, 4)):
        try:
            build_engine(model, "dspark", draft=loaded_d, sps=out, num_slots=4, capacity=64, mesh=mesh,
                         model_name="tiny-random")
            refused["1x1" if mesh is None else "2x4"] = False
        except ValueError as e:
            assert "mesh" in str(e) and "--allow-sps-mesh-mismatch" in str(e), e
            refused["1x1" if mesh is None else "2x4"] = True
    assert all(refused.values()), refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_engine(model, "dspark", draft=loaded_d, sps=out, num_slots=4, capacity=64, mesh=make_mesh(2, 4),
                     model_name="tiny-random", allow_sps_mesh_mismatch=True)
    assert any("mesh" in str(w.message) for w in caught)
    engine = build_engine(model, "dspark", draft=loaded_d, sps=out, num_slots=4, capacity=64, mesh=make_mesh(4, 2),
                          model_name="tiny-random")
    assert engine.cost is not None  # the table's cost model drives the engine on its own mesh
    return {"mesh": table_mesh(loaded), "refused": refused}


def check_train() -> dict:
    """One drafter training step data-parallel on a 2-device mesh equals the single-device step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dspark_jax import training
    from dspark_jax.sharding import make_mesh

    model, d = tiny_target_and_drafter(block=3)
    cfg = d.cfg
    N, S, B, G, D = 4, 24, 3, cfg.block, model.cfg.dim
    rng = np.random.default_rng(0)
    final = rng.normal(size=(N, B, G, D)).astype(np.float32)
    logits = final @ np.asarray(model.weights.embed).T
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    batch = {"taps": jnp.asarray(rng.normal(size=(N, S, cfg.n_taps, D)).astype(np.float32)),
             "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (N, S)).astype(np.int32)),
             "anchors": jnp.asarray(rng.integers(1, S - G - 1, (N, B)).astype(np.int32)),
             "valid": jnp.asarray(rng.random((N, B, G)) < 0.9), "final": jnp.asarray(final),
             "lse": jnp.asarray(lse.astype(np.float32))}
    import optax

    tx = optax.sgd(1.0)  # the parameters move by the gradients: equal steps mean equal gradients
    graphdef, params, buffers = nnx.split(d, nnx.Param, ...)
    step = training.make_train_step(graphdef, training.LossConfig(), tx)
    embed, lm_head = model.weights.embed, model.weights.lm_head
    ref_params, _, ref_m = step(params, buffers, tx.init(params), batch, embed, lm_head)
    mesh = make_mesh(2, 1)
    p2, b2, o2, e2, h2 = training.replicate((params, buffers, tx.init(params), embed, lm_head), mesh)
    sharded = training.shard_batch(batch, mesh)
    assert sharded["taps"].sharding.spec[0] == "data", sharded["taps"].sharding
    new_params, _, m = step(p2, b2, o2, sharded, e2, h2)
    assert m["loss"].sharding.is_fully_replicated, m["loss"].sharding
    np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=1e-5)
    worst = 0.0
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(new_params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
        worst = max(worst, float(np.max(np.abs(np.asarray(b) - np.asarray(a)))))
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
                zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)))
    assert moved > 1e-4  # the step changed the parameters, so equal results are a real comparison
    return {"loss": float(m["loss"]), "max_abs_param_diff": worst, "param_change": moved}


def worker(process_id: int, num_processes: int, port: int, out: str) -> dict:
    """One process of a multi-process run (``jax.distributed`` over localhost, CPU collectives): the engine
    on a mesh over every process's devices, every process feeding the same requests."""
    from dspark_jax.sharding import initialize_distributed, make_mesh

    initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)
    import jax

    model, d = tiny_target_and_drafter()
    ps = prompts(5, seed=5)
    budgets = [6, 3, 8, 1, 5]
    if process_id == 1:  # this process's clock runs 3 x: measured round times differ between the processes
        import time

        from dspark_jax.engine import loop  # the engine's host loop reads its clock

        real = time.perf_counter
        loop.time = type("SkewedTime", (), {"perf_counter": staticmethod(lambda: 3.0 * real())})
    # slots split over the processes: each round's outputs are gathered from both (`sharding.to_host`); the
    # engine's default GateConfig.calibrate_times, which must not let each process's clock steer its own programs
    out_ids, _, e = run_engine(model, d, "dspark", ps, budgets, mesh=make_mesh(num_processes, 1),
                               calibrate_times=True)
    result = {"process": jax.process_index(), "devices": jax.device_count(), "outputs": {"dspark": out_ids},
              "calibrate_times": e.gate_cfg.calibrate_times}
    with open(out, "w") as f:
        json.dump(result, f)
    return result


def check_collectives() -> dict:
    """One request on four slots (fewer rows than slots) on a 2x1 mesh, greedy and sampled, `fixed:3`: the
    programs the run compiled are dumped (XLA_FLAGS --xla_dump_to, set by the caller), which the caller reads
    for collectives that move a cache's context axis (capacity 128, an extent no other axis here has)."""
    import numpy as np

    from dspark_jax.engine import Engine, EngineConfig, SamplingParams
    from dspark_jax.gate import GateConfig
    from dspark_jax.sharding import make_mesh

    model, d = tiny_target_and_drafter()
    sps = np.linspace(10.0, 1.0, 48).astype(np.float32)
    e = Engine(model, d, "fixed:3", EngineConfig(num_slots=4, capacity=128, gate=GateConfig(calibrate_times=False)),
               sps=sps, stop_ids=[], mesh=make_mesh(2, 1))
    p = prompts(1, seed=5)[0]
    ids = [e.submit(p, 6), e.submit(p, 6, SamplingParams(temperature=1.0, seed=1))]
    while not e.idle():
        e.step()
    return {"outputs": [e.requests[i].output_ids for i in ids], "max_active": max(r.active for r in e.rounds)}


def single_process_reference() -> dict:
    """What `worker` computes, on one device."""
    model, d = tiny_target_and_drafter()
    ps = prompts(5, seed=5)
    budgets = [6, 3, 8, 1, 5]
    return {"dspark": run_engine(model, d, "none", ps, budgets)[0]}  # greedy: plain decoding's tokens


def main(argv: list[str]) -> None:
    what = argv[0]
    if what == "engine":
        result = check_engine()
        result["law"] = check_law()
    elif what == "paged":
        result = check_paged()
    elif what == "profile":
        result = check_profile(argv[1])
    elif what == "train":
        result = check_train()
    elif what == "worker":
        result = worker(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
    elif what == "collectives":
        result = check_collectives()
    elif what == "reference":
        result = single_process_reference()
    else:
        raise SystemExit(f"unknown check {what!r}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
