"""Train a DSpark (or DFlash baseline) drafter on the target cache. Resumable: run the same command again.

    python -m train.train_drafter --cache runs/data/cache --run runs/dspark --kind dspark --steps 2000
    python -m train.train_drafter --cache runs/data/cache --run runs/dflash --kind dflash --steps 2000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flax import nnx

from dspark_jax import data, training
from dspark_jax.build import add_model_arguments, load_target
from dspark_jax.models.drafter import Drafter, DrafterConfig
from dspark_jax.plots import plot_training


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default="runs/data/cache")
    p.add_argument("--run", required=True, help="run folder (checkpoints, metrics, export)")
    p.add_argument("--kind", choices=["dspark", "dflash"], default="dspark")
    p.add_argument("--head", choices=["markov", "rnn"], default="markov", help="sequential head for dspark")
    add_model_arguments(p, draft=False)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--rank", type=int, default=256, help="Markov / RNN head rank (the spec's 256)")
    p.add_argument("--block", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192, help="0 = full target vocabulary")
    p.add_argument("--blocks", type=int, default=256, help="blocks per batch")
    p.add_argument("--context-tokens", type=int, default=2048, help="context tokens per batch")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    target = load_target(args.model, dtype=args.dtype)
    cache = data.open_target_cache(args.cache)
    freqs = data.token_frequencies(cache, target.cfg.vocab_size)
    vocab = training.choose_draft_vocab(freqs, args.draft_vocab, always=tuple(target.tokenizer.stop_ids))
    covered = freqs[vocab].sum() / max(freqs.sum(), 1)
    dspark = args.kind == "dspark"
    cfg = DrafterConfig.for_target(
        target.cfg, n_layers=args.layers, ffn_dim=args.ffn, block=args.block, rank=args.rank,
        head=args.head if dspark else "none", confidence=dspark,
        draft_vocab_size=0 if len(vocab) == target.cfg.vocab_size else len(vocab),
    )
    drafter = Drafter(cfg, rngs=nnx.Rngs(args.seed), vocab_ids=vocab)
    loader = data.BlockLoader(cache, block=args.block, blocks=args.blocks, context_tokens=args.context_tokens,
                              seed=args.seed)
    n_params = sum(x.size for x in __import__("jax").tree.leaves(nnx.state(drafter, nnx.Param)))
    print(f"{args.kind}: {n_params / 1e6:.2f}M trainable parameters, draft vocabulary {len(vocab)} "
          f"({covered:.2%} of assistant tokens), {loader.num_tokens} tokens in {cache.num_sequences} sequences")
    tc = training.TrainConfig(steps=args.steps, lr=args.lr, seed=args.seed)
    loss_cfg = training.LossConfig() if dspark else training.LossConfig.dflash()
    t0 = time.perf_counter()
    drafter = training.train(drafter, loader, target.weights.embed, target.weights.lm_head, tc=tc,
                             loss_cfg=loss_cfg, run_dir=run)
    wall = time.perf_counter() - t0
    plot_training(run / "metrics.jsonl", run / "training.png", title=f"{args.kind} ({args.steps} steps)")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    info = {"kind": args.kind, "steps": args.steps, "params": int(n_params), "draft_vocab_coverage": float(covered),
            "train_tokens": loader.num_tokens, "final_tau_prob": last["tau_prob"],
            "wall_seconds_this_run": wall, "args": vars(args)}
    training.save_drafter(drafter, run / "export", extra={"training": info})
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
