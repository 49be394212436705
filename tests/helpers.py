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
