"""Profile an SPS table with a cost model: the target's packed verification and the drafter's block.

    python -m profiling.profile_sps [--quick] [--out TABLE.json] [--max-tokens 512]
        [--context-lengths 128 512 1024] [--repeats 5] [--model GGUF|HF_FOLDER | --tiny] [--dtype auto] [--backend gpu]
        [--tensor-parallel-size N] [--data-parallel-size M]

With ``--tensor-parallel-size`` / ``--data-parallel-size`` the target and drafter are laid out on that device
mesh (as the engine lays them out) and timed there; the table records the mesh, and an engine on another
mesh refuses it (`sharding.check_table_mesh`).

Runs on the backend JAX selects (CPU, GPU or TPU); `--backend` insists on one. Writes the table (JSON,
atomically) and a PNG beside it, and prints the curves. `--quick` measures one context and four buckets up
to 256 (under a minute on two CPU cores); the default measures every (rows, bucket) cell a round can use.
Last, it runs the engine at every row count to measure what a whole round costs beyond those programs
(`--quick`: the smallest row count; `--no-overhead` skips it; `--add-overhead` adds it to an existing table).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from dspark_jax import build, measure
from dspark_jax.sharding import add_mesh_arguments, describe_mesh, mesh_from_args, place_target_weights
from dspark_jax.plots import plot_sps
from dspark_jax.io import check_writable
from dspark_jax.timing import format_table
from dspark_jax.sps import DEFAULT_WINDOW_RULE, WINDOW_RULES
from dspark_jax.cli import nonnegative_float, positive_float, positive_int

DEFAULT_OUT = Path("runs/sps/sps_table.json")
QUICK_BUCKETS = (8, 32, 128, 256, 512, 1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one context (120), buckets 8/32/128/256, 2 repeats")
    p.add_argument("--out", type=Path, help=f"JSON table (default {DEFAULT_OUT}); the PNG goes beside it")
    p.add_argument("--png", type=Path, help="plot path (default: --out with .png)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--max-tokens", type=positive_int, help="largest verification batch B (default 512; --quick 256)")
    p.add_argument("--context-lengths", type=positive_int, nargs="+",
                   help="tokens held per request (default 120 248 504 1016, filling the windows 128 to 1024; "
                        "--quick 120)")
    p.add_argument("--reference-context", type=positive_int, help="context of the simple SPS(B) points (default: smallest)")
    p.add_argument("--rows", type=positive_int, nargs="+", help="row buckets (default: powers of two up to max-tokens / 8)")
    p.add_argument("--repeats", type=positive_int, help="timed calls per cell (default 5; --quick 2)")
    p.add_argument("--max-seconds", type=positive_float, help="stop repeating a cell after this long (>= 3 repeats)")
    p.add_argument("--min-seconds", type=nonnegative_float,
                   help="the programs of one (context, rows) group, timed in turns, take more turns (up to 4 x "
                        "--repeats) until their timed calls add up to this (default 1; --quick 0)")
    p.add_argument("--block", type=positive_int, default=measure.DEFAULT_BLOCK, help="drafted tokens per request G")
    p.add_argument("--window-rule", choices=WINDOW_RULES, default=DEFAULT_WINDOW_RULE,
                   help="attention windows: multiples of 128 (the engine default) or powers of two from 128")
    p.add_argument("--no-drafter", action="store_true", help="record no draft cost")
    p.add_argument("--draft", help="time this drafter (dspark, dflash or a folder; its block replaces --block); "
                                   "default: a random drafter of the shipped shape")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a GGUF file or a Hugging Face checkpoint folder (default: the embedded "
                                     "SmolLM2-135M-Instruct GGUF)")
    src.add_argument("--tiny", action="store_true", help="a random tiny model (tests)")
    p.add_argument("--dtype", choices=("auto", *build.DTYPES), default="auto",
                   help="target weights (auto: bfloat16 on an accelerator, float32 on CPU)")
    p.add_argument("--backend", help="insist on a backend (cpu, gpu, tpu); default: JAX's choice")
    p.add_argument("--markdown", action="store_true", help="also print the curves as a Markdown table (README)")
    add_mesh_arguments(p)
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the engine-round overhead (the host's share of a round, measured by running the engine)")
    p.add_argument("--add-overhead", action="store_true",
                   help="measure only the engine-round overhead of the table at --out, with the shipped drafter's "
                        "shape, and write it back (for tables profiled before it was part of the profile)")
    p.add_argument("--no-host-speed", action="store_true",
                   help="keep every time as measured (default on a CPU: each is put at the host's median speed "
                        "over the profile, from a small reference program timed between measurements, for hosts "
                        "whose speed drifts; on a GPU or TPU times are always kept as measured, the reference "
                        "program there timing the host's dispatch rather than the device)")
    p.add_argument("--add-plain", action="store_true",
                   help="measure only the plain rounds (no drafts) of the table at --out and write it back "
                        "(for tables profiled before plain rounds were part of the profile)")
    return p.parse_args(argv)


def curve_rows(table) -> list[dict]:
    """One row per (context, bucket) of the simple curve: rows R, verify / draft / round ms, rounds/s, tokens/s."""
    cm = table.cost_model
    rows = []
    for L in cm.context_lengths:
        c = cm.curve(L)
        for i, b in enumerate(c["batch_tokens"]):
            rows.append({"L": L, "B": int(b), "R": int(c["rows"][i]), "verify_ms": 1e3 * c["verify_s"][i],
                         "draft_ms": 1e3 * c["draft_s"][i], "overhead_ms": 1e3 * c["overhead_s"][i],
                         "round_ms": 1e3 * c["step_s"][i],
                         "rounds_per_s": 1 / c["step_s"][i], "tokens_per_s": b / c["step_s"][i]})
    return rows


def markdown(table) -> str:
    """B against rounds/s and verified tokens/s, one column pair per context length."""
    rows = curve_rows(table)
    contexts = table.cost_model.context_lengths
    by = {(r["L"], r["B"]): r for r in rows}
    head = "| B | R | " + " | ".join(f"rounds/s, L={L} | tokens/s, L={L}" for L in contexts) + " |"
    sep = "| ---: | ---: | " + " | ".join("---: | ---:" for _ in contexts) + " |"
    lines = [head, sep]
    for b in table.cost_model.batch_tokens:
        cells = [f"{by[(L, b)]['rounds_per_s']:.3g} | {by[(L, b)]['tokens_per_s']:.0f}" for L in contexts]
        lines.append(f"| {b} | {by[(contexts[0], b)]['R']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_target(args, mesh=None, backend=None):
    from dspark_jax.models.llama import LlamaConfig, init_random_weights

    dtype = jnp.dtype(build.parse_dtype(args.dtype, backend))  # "auto": for the device profiled
    if args.tiny:
        cfg = LlamaConfig.tiny()
        return cfg, init_random_weights(cfg, jax.random.key(0), dtype), "tiny-random"
    model = build.load_target(args.model, dtype=dtype, mesh=mesh)  # read on the host, each device its shards
    return model.cfg, model.weights, build.target_name(args.model)


def overhead_lines(cm) -> list[str]:
    """The engine-round overhead of a cost model, in ms: plain rounds by row count, drafting rounds by row
    count and padded batch."""
    lines = ["plain round overhead ms " + " ".join(f"R={r}:{1e3 * cm.overhead_s[1][i]:.1f}"
                                                   for i, r in enumerate(cm.rows))]
    table = cm.draft_overhead_table()
    for i, r in enumerate(cm.rows):
        lines.append(f"drafting round overhead ms R={r}: " + " ".join(
            f"B={b}:{1e3 * table[i, t]:.1f}" for t, b in enumerate(cm.batch_tokens)
            if b in measure.overhead_batches(cm, r)))
    return lines


def with_overhead(table, weights, cfg, rows=None, host_speed=True, drafter=None):
    """``table`` with the engine-round overhead measured (with ``drafter``, default a random drafter of the shipped
    shape) at ``rows`` (default: every row count of its cost model), at the table's host speed unless
    ``host_speed`` is False."""
    from dspark_jax.models.llama import LlamaModel

    drafter = drafter or measure.random_drafter(cfg, block=table.cost_model.block)
    return measure.add_round_overhead(table, LlamaModel(cfg, weights), drafter, progress=True, rows=rows,
                                        host_speed=host_speed)


def placed(weights, cfg, device, mesh):
    """The target's weights on ``device``, or laid out on ``mesh``."""
    return jax.device_put(weights, device) if mesh is None else place_target_weights(weights, cfg, mesh)


def extend_table(args, device, out, extend, report, mesh=None):
    """Load the table at ``out``, add to it ``extend(table, weights, cfg)`` with the target on ``device``, write it
    back and print ``report(cost_model)`` (lines)."""
    from dspark_jax.sps import load_sps_table

    table = load_sps_table(out)
    differ = [f"{name.replace('_', ' ')} {have!r} there, {want!r} here" for name, have, want in
              table.metadata_mismatches(backend=device.platform, device_kind=device.device_kind,
                                        dtype=jnp.dtype(build.parse_dtype(args.dtype, device.platform)).name)]
    if differ:
        raise ValueError(f"{out}: measured elsewhere ({'; '.join(differ)}): adding to it here would mix two "
                         f"machines' times in one table; profile a new table on this device")
    cfg, weights, _ = load_target(args, mesh, device.platform)
    with jax.default_device(device):
        table = extend(table, placed(weights, cfg, device, mesh), cfg)
    if jax.process_index() == 0:  # under several processes, one file
        table.save(out)
    for line in report(table.cost_model):
        print(line)
    print(f"wrote {out}")
    return table


def main(argv=None):
    args = parse_args(argv)
    mesh = mesh_from_args(args)  # first: a multi-process run joins before anything touches JAX
    # Everything that can fail fast fails before anything is loaded or measured.
    # on a mesh: this process's first device of it (under several processes the mesh's first may be another's)
    device = measure.select_device(args.backend) if mesh is None else next(
        d for d in mesh.devices.flat if d.process_index == jax.process_index())
    host_speed = not args.no_host_speed and device.platform == "cpu"
    # Several processes run each program together (its collectives span them): every one must time the same
    # calls the same number of times, so no process's clock may decide how many; only process 0 writes.
    multi = jax.process_count() > 1
    writer = jax.process_index() == 0
    if multi:
        if args.min_seconds or args.max_seconds:
            raise ValueError("--min-seconds / --max-seconds: under several processes every process must make the "
                             "same calls, so the repeats are fixed (--repeats); leave them out")
        host_speed = False
    out = args.out or DEFAULT_OUT
    if args.out is None:
        out.parent.mkdir(parents=True, exist_ok=True)
    check_writable(out)
    png = None if args.no_plot else (args.png or out.with_suffix(".png"))
    if png is not None:
        check_writable(png)
    max_tokens = args.max_tokens or (256 if args.quick else measure.DEFAULT_MAX_TOKENS)
    contexts = args.context_lengths or (measure.DEFAULT_CONTEXT_LENGTHS[:1] if args.quick
                                        else measure.DEFAULT_CONTEXT_LENGTHS)
    repeats = args.repeats or (2 if args.quick else 5)
    if args.min_seconds is not None and args.min_seconds < 0:
        raise ValueError(f"--min-seconds {args.min_seconds}: expected a number of seconds >= 0")
    buckets = measure.token_buckets(max_tokens)
    if args.quick:
        buckets = tuple(sorted({b for b in buckets if b in QUICK_BUCKETS} | {buckets[-1]}))
    if args.reference_context is not None and args.reference_context not in contexts:
        raise ValueError(f"--reference-context {args.reference_context} must be one of --context-lengths {contexts}")

    if args.add_overhead:
        def overhead(table, weights, cfg):
            from dspark_jax.models.llama import LlamaModel

            drafter = None if args.draft is None else build.load_drafter_for(LlamaModel(cfg, weights),
                                                                             args.draft).drafter
            return with_overhead(table, weights, cfg, host_speed=host_speed, drafter=drafter)

        return extend_table(args, device, out, overhead, overhead_lines, mesh)

    if args.add_plain:
        def plain(table, weights, cfg):
            return measure.add_plain_rounds(table, weights, cfg, repeats=repeats, max_seconds=args.max_seconds,
                                              host_speed=host_speed, progress=True)

        return extend_table(args, device, out, plain, lambda cm: [
            f"L={L}: plain round ms " + " ".join(f"R={r}:{1e3 * cm.plain_s[c][i]:.1f}" for i, r in enumerate(cm.rows))
            for c, L in enumerate(cm.context_lengths)], mesh)

    cfg, weights, name = load_target(args, mesh, device.platform)
    drafter, block = None, args.block
    if args.draft is not None and not args.no_drafter:
        from dspark_jax.models.llama import LlamaModel

        drafter = build.load_drafter_for(LlamaModel(cfg, weights), args.draft).drafter
        block = drafter.cfg.block
    on = f" on a {describe_mesh(mesh)} mesh" if mesh is not None else ""
    print(f"profiling {name} ({jnp.dtype(weights.embed.dtype).name}) on {device.platform} ({device.device_kind}){on}: "
          f"B up to {buckets[-1]}, "
          f"contexts {list(contexts)}, {repeats} repeats, {'diagonal' if args.quick else 'all'} cells")
    table = measure.profile_sps_table(
        weights, cfg, model=name, context_lengths=contexts,
        reference_context=args.reference_context, rows=args.rows, diagonal=args.quick, block=block, drafter=drafter,
        window_rule=args.window_rule, with_drafter=not args.no_drafter, round_overhead=False,
        host_speed=host_speed,
        repeats=repeats, max_seconds=args.max_seconds, device=device,
        min_seconds=args.min_seconds if args.min_seconds is not None else (0.0 if args.quick or multi else 1.0),
        progress=True, extra={"quick": args.quick}, batch_tokens=buckets, mesh=mesh)
    if writer:
        table.save(out)  # the programs' costs are kept even if the overhead measurement below fails
    drift = table.metadata.extra.get("host_drift")
    if drift:
        print(f"host speed while profiling: the reference program ({table.metadata.extra['host_reference']}) "
              f"took {drift[0]:.2f}-{drift[1]:.2f} x its median "
              f"{1e3 * table.metadata.extra['host_reference_s']:.1f} ms; every time is put at the median")
    if not args.no_overhead and not args.no_drafter:
        print(f"wrote {out} (programs only); measuring the engine-round overhead "
              f"(if this stops, `--add-overhead --out {out}` measures it alone)")
        rows = table.cost_model.rows[:1] if args.quick else None
        with jax.default_device(device):
            table = with_overhead(table, placed(weights, cfg, device, mesh), cfg, rows=rows,
                                  host_speed=host_speed, drafter=drafter)
        if writer:
            table.save(out)
    print(format_table(curve_rows(table),
                       ["L", "B", "R", "verify_ms", "draft_ms", "overhead_ms", "round_ms", "rounds_per_s",
                        "tokens_per_s"]))
    if args.markdown:
        print(markdown(table))
    if not writer:
        return table
    print(f"wrote {out}")
    if png is not None:
        plot_sps(table, png, title="SPS profile")
        print(f"wrote {png}")
    return table


if __name__ == "__main__":
    main()
