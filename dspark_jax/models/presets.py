"""Named model shapes: real targets' and DeepSpec drafters' hyperparameters, for planning memory and for
accelerator checks with random weights of a real model's shape (no download).

The values are the models' published configs (Hugging Face ``config.json`` of the target; DeepSpec's training
configs for the drafters: 5 Qwen3 draft layers, block 7, taps evenly spaced from layer 1, ``mask_token_id``
151669, Markov rank 256 with a confidence head on ``[h ; W1[x_prev]]`` for DSpark, no head for DFlash). A
DeepSpec drafter carries its own copy of the target's embedding and LM head; the preset shares the target's
(``own_embeddings`` False): the copies are frozen and equal, and an engine keeps one.

>>> target_shape("qwen3-8b").n_layers, draft_shape("dspark-qwen3-8b").n_layers
(36, 5)
"""

from __future__ import annotations

from dspark_jax.models.drafter import DrafterConfig
from dspark_jax.models.llama import SMOLLM2_135M, LlamaConfig

__all__ = ["TARGET_SHAPES", "DRAFT_SHAPES", "target_shape", "draft_shape"]


def _qwen3(dim: int, n_layers: int, n_heads: int, ffn_dim: int, *, tie: bool, taps: tuple[int, ...]) -> LlamaConfig:
    return LlamaConfig(vocab_size=151936, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
                       ffn_dim=ffn_dim, rope_base=1_000_000.0, norm_eps=1e-6, tie_embeddings=tie, qk_norm=True,
                       tap_layers=taps)


TARGET_SHAPES: dict[str, LlamaConfig] = {
    "smollm2-135m": SMOLLM2_135M,
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tie=True, taps=(1, 9, 17, 25, 33)),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tie=False, taps=(1, 9, 17, 25, 33)),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, tie=False, taps=(1, 10, 19, 28, 37)),
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                             ffn_dim=14336, rope_base=500_000.0, norm_eps=1e-5, tie_embeddings=False),
}


def _deepspec(target: str, *, dspark: bool) -> DrafterConfig:
    heads = dict(head="markov", rank=256, confidence=True) if dspark else dict(head="none", confidence=False)
    return DrafterConfig.for_target(TARGET_SHAPES[target], n_layers=5, block=7, mask_token=151669, qk_norm=True,
                                    tap_layers=TARGET_SHAPES[target].tap_layers, **heads)


DRAFT_SHAPES: dict[str, DrafterConfig] = {
    f"{kind}-{target}": _deepspec(target, dspark=kind == "dspark")
    for kind in ("dspark", "dflash") for target in ("qwen3-4b", "qwen3-8b", "qwen3-14b")
}


def target_shape(name: str) -> LlamaConfig:
    """The `LlamaConfig` of a named target shape (``TARGET_SHAPES``); ValueError naming the known ones."""
    if name not in TARGET_SHAPES:
        raise ValueError(f"target shape {name!r}: expected one of {', '.join(TARGET_SHAPES)}")
    return TARGET_SHAPES[name]


def draft_shape(name: str) -> DrafterConfig:
    """The `DrafterConfig` of a named drafter shape (``DRAFT_SHAPES``); ValueError naming the known ones."""
    if name not in DRAFT_SHAPES:
        raise ValueError(f"draft shape {name!r}: expected one of {', '.join(DRAFT_SHAPES)}")
    return DRAFT_SHAPES[name]
