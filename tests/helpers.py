"""Small test utilities shared by several test modules."""

from __future__ import annotations

import contextlib

from dspark_jax.timing import compile_count


@contextlib.contextmanager
def count_compilations():
    """Counts XLA backend compilations inside the block: ``with count_compilations() as n: ...; n()``."""
    start = compile_count()
    yield lambda: compile_count() - start


def small_real_vocab_target(target):
    """A small random-weight Llama with the real target's vocabulary and tokenizer: what script tests load in
    place of the real model when the script's plumbing, not the model, is under test."""
    import jax

    from dspark_jax.models.llama import LlamaConfig, LlamaModel, init_random_weights

    cfg = LlamaConfig.tiny(vocab_size=target.cfg.vocab_size)
    return LlamaModel(cfg, init_random_weights(cfg, jax.random.key(0), scale=0.3), target.tokenizer)


def save_random_drafter(target_cfg, path, draft_vocab=512, **overrides):
    """A random one-layer drafter for ``target_cfg`` over the first ``draft_vocab`` tokens, saved at ``path``
    (a folder that ``--draft PATH`` accepts); returns ``path``."""
    import numpy as np
    from flax import nnx

    from dspark_jax.models.drafter import Drafter, DrafterConfig
    from dspark_jax.models.drafter_files import save_drafter

    cfg = DrafterConfig.for_target(target_cfg, n_layers=1, ffn_dim=64, rank=8, draft_vocab_size=draft_vocab,
                                   **overrides)
    save_drafter(Drafter(cfg, rngs=nnx.Rngs(0), vocab_ids=np.arange(draft_vocab)), path)
    return path


def synthetic_cost_table(block=4, draft_cost=0.002):
    """An SPS table with a cost model: steps get slower with rows, tokens and context."""
    from dspark_jax.sps import CostModel, SPSMetadata, SPSTable, round_windows

    contexts = (0, 200)
    windows = [round_windows(L, block, 128, "step") for L in contexts]
    rows, toks = (1, 2, 4), (8, 16, 32)
    verify = tuple(tuple(tuple(0.01 * (1 + c) + 0.001 * r + 0.0005 * t for t in toks) for r in rows)
                   for c in range(len(contexts)))
    zeros3 = tuple(tuple(tuple(0.0 for _ in toks) for _ in rows) for _ in contexts)
    draft = tuple(tuple(draft_cost * r for r in rows) for _ in contexts)
    zeros2 = tuple(tuple(0.0 for _ in rows) for _ in contexts)
    cm = CostModel(block=block, context_step=128, window_rule="step", context_lengths=contexts,
                   windows=tuple(w[0] for w in windows), draft_windows=tuple(w[1] for w in windows), rows=rows,
                   batch_tokens=toks, verify_s=verify, verify_spread_s=zeros3, draft_s=draft, draft_spread_s=zeros2)
    points = SPSTable.from_arrays(toks, [1 / verify[0][-1][i] for i in range(3)]).points
    return SPSTable(points, SPSMetadata(), cost_model=cm)


def assert_follows_law(outputs, law) -> None:
    """Chi-square test at p = 0.001 that ``outputs`` (sequences of m token ids) were drawn from ``law``
    (an exact joint distribution [V] * m): cells expected below 5 are pooled; Wilson-Hilferty critical value."""
    import numpy as np

    counts = np.zeros_like(law)
    for ids in outputs:
        counts[tuple(ids)] += 1
    expected = law * len(outputs)
    big = expected >= 5
    chi2 = (((counts - expected) ** 2)[big] / expected[big]).sum()
    small_obs, small_exp = counts[~big].sum(), expected[~big].sum()
    if small_exp > 0:
        chi2 += (small_obs - small_exp) ** 2 / small_exp
    dof = int(big.sum()) + (small_exp > 0) - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit, dof)

