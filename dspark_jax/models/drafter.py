"""The DSpark drafter in Flax NNX: a DFlash-style parallel backbone, a sequential head and a confidence head.

Spec section 2. The backbone reads context features (tapped target layers, projected and normed) injected
as extra keys and values into every draft layer, and a block ``[x0, MASK, ..., MASK]`` of G slots attending
bidirectionally to itself; slot k predicts token ``x_{k+1}``. The frozen target embedding and LM head are
passed in as arrays (never trained, never stored with the drafter). The sequential head adds a bias that
depends on the previous token (Markov, low rank; or gated by the hidden state) or on a small recurrent state
(RNN), and the confidence head reads ``[h_k ; W1[x_k]]`` (or ``h_k`` alone) to estimate the chance that
``x_{k+1}`` survives verification.

Switches for drafters trained elsewhere (DeepSpec's ``Qwen3DSparkModel``, `dspark_jax.models.deepspec`), each off
by default: RMSNorm of every head's queries and keys before RoPE (``qk_norm``), the block slots embedded as a
vocabulary row (``mask_token``) instead of a learned vector, the drafter's own embedding and LM head copies
(``own_embeddings``) instead of the target's, a confidence head on ``h_k`` alone (``confidence_prev=False``), and
the target layers it was trained on (``tap_layers``).

A reduced draft vocabulary (W of the V target tokens) is optional: the drafter then only proposes those
tokens, its distributions are over them (zero elsewhere), and verification stays exact.

Axis legend (einsum letters): N sequences or request slots, S context positions, B blocks per sequence
(1 at inference), G block slots, D width, H query heads, K key/value heads, Q = H / K, E head dim,
M tapped target layers, V target vocabulary, W draft vocabulary, r rank of the sequential head,
L draft layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from dspark_jax.models.llama import first_argmax, online_softmax_step, over_context, rope
from dspark_jax.sampling import categorical, safe_log

HEADS = ("markov", "gated", "rnn", "none")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static drafter hyperparameters (hashable)."""

    vocab_size: int  # V, the target's vocabulary
    dim: int  # D, the target's width (the embedding and LM head are shared)
    n_taps: int = 5
    n_layers: int = 2
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    block: int = 7  # G
    head: str = "markov"
    rank: int = 64
    confidence: bool = True
    draft_vocab_size: int = 0  # W; 0 means the full target vocabulary
    rope_base: float = 100000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3 layers)
    mask_token: int | None = None  # the block slots' input: this token's embedding row; None: a learned vector
    own_embeddings: bool = False  # its own embedding [V, D] and LM head [D, W], not the target's
    confidence_prev: bool = True  # the confidence head reads [h_k ; W1[x_k]]; False: h_k alone
    tap_layers: tuple[int, ...] | None = None  # the target layers it reads; None: whatever the target taps
    tap_norm: bool = False  # RMSNorm each tapped layer (own scale per tap) before the context projection

    def __post_init__(self):
        if self.tap_layers is not None:
            object.__setattr__(self, "tap_layers", tuple(int(i) for i in self.tap_layers))
            if len(self.tap_layers) != self.n_taps:
                raise ValueError(f"tap_layers {self.tap_layers}: expected n_taps={self.n_taps} layer ids")
        if self.mask_token is not None and not 0 <= self.mask_token < self.vocab_size:
            raise ValueError(f"mask_token must lie in [0, {self.vocab_size}), got {self.mask_token}")
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must lie in [0, {self.vocab_size}], got {self.draft_vocab_size}")

    @property
    def draft_vocab(self) -> int:
        """W, the number of tokens the drafter can propose."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def uses_prev_token(self) -> bool:
        """Whether a head reads W1 of the previous token (the table exists)."""
        return self.head != "none" or (self.confidence and self.confidence_prev)

    @property
    def sequential(self) -> bool:
        """Whether a sequential or confidence head runs after the backbone."""
        return self.head != "none" or self.confidence

    @classmethod
    def for_target(cls, target_cfg, **overrides) -> "DrafterConfig":
        """A drafter matching a LlamaConfig (width, heads, RoPE, taps), with overrides."""
        base = dict(vocab_size=target_cfg.vocab_size, dim=target_cfg.dim, n_taps=len(target_cfg.tap_layers),
                    n_heads=target_cfg.n_heads, n_kv_heads=target_cfg.n_kv_heads, head_dim=target_cfg.head_dim,
                    ffn_dim=target_cfg.ffn_dim, rope_base=target_cfg.rope_base, norm_eps=target_cfg.norm_eps)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown drafter config fields {sorted(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["tap_layers"] is not None:
            d["tap_layers"] = list(d["tap_layers"])
        return d


class Buffer(nnx.Variable):
    """A non-trainable array stored with the module (the draft vocabulary maps)."""


def _init(scale=0.02):
    return nnx.initializers.normal(scale)


class DraftLayer(nnx.Module):
    """Pre-norm decoder layer whose keys and values are [context ; block] (KV injection)."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        D, H, K, E, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
        self.cfg = cfg
        lin = functools.partial(nnx.Linear, use_bias=False, kernel_init=_init(), rngs=rngs)
        self.attn_norm = nnx.RMSNorm(D, epsilon=cfg.norm_eps, rngs=rngs)
        self.wq, self.wk, self.wv, self.wo = lin(D, H * E), lin(D, K * E), lin(D, K * E), lin(H * E, D)
        self.mlp_norm = nnx.RMSNorm(D, epsilon=cfg.norm_eps, rngs=rngs)
        self.w_gate, self.w_up, self.w_down = lin(D, F), lin(D, F), lin(F, D)
        if cfg.qk_norm:
            self.q_norm = nnx.RMSNorm(E, epsilon=cfg.norm_eps, rngs=rngs)
            self.k_norm = nnx.RMSNorm(E, epsilon=cfg.norm_eps, rngs=rngs)

    def _rope(self, x, positions):
        """x [..., K, E], positions [...] -> RoPE'd x."""
        lead = x.shape[:-2]
        flat = rope(x.reshape(-1, *x.shape[-2:]), positions.reshape(-1), self.cfg.rope_base)
        return flat.reshape(*lead, *x.shape[-2:])

    def context_kv(self, h_ctx: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys (after RoPE) and values of context features: [..., D] -> ([..., K, E], [..., K, E])."""
        K, E = self.cfg.n_kv_heads, self.cfg.head_dim
        k = self.wk(h_ctx).reshape(*h_ctx.shape[:-1], K, E)
        if self.cfg.qk_norm:
            k = self.k_norm(k)
        k = self._rope(k, positions)
        v = self.wv(h_ctx).reshape(*h_ctx.shape[:-1], K, E)
        return k, v

    def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask):
        """One layer over the blocks.

        Args:
          x: [N, B, G, D] block hidden states.
          positions: int [N, B, G] RoPE positions of the block slots.
          ctx_k, ctx_v: [N, S, K, E] context keys (after RoPE) and values.
          ctx_mask: bool [N, B, S] which context positions each block sees.
        Returns:
          [N, B, G, D].
        """
        visible = ctx_mask[:, None, :, None, None, :]  # [N, 1, B, 1, 1, S]
        return self._layer(x, positions, lambda q, carry: _context_part(q, carry, ctx_k, ctx_v, visible))

    def cached(self, x, positions, context: "CachedContext", layer: int):
        """One layer over one block per row (inference), its context read from the drafter's cache in parts
        (`CachedContext`, layer ``layer``): x [N, 1, G, D], positions int [N, 1, G] -> [N, 1, G, D]."""
        return self._layer(x, positions, lambda q, carry: context.fold(layer, q, carry))

    def _layer(self, x, positions, fold_context):
        """The layer, its attention over [context ; block]: ``fold_context(q, carry) -> carry`` folds the
        context's parts into the block's softmax state (`llama.online_softmax_step`)."""
        cfg = self.cfg
        N, B, G, _ = x.shape
        H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        Q = H // K
        h = self.attn_norm(x)
        q = self.wq(h).reshape(N, B, G, H, E)
        if cfg.qk_norm:
            q = self.q_norm(q)
        q = self._rope(q, positions).reshape(N, B, G, K, Q, E) * (E**-0.5)
        kb, vb = self.context_kv(h, positions)  # [N, B, G, K, E]
        # Scores laid out [N, K, B, G, Q, *]: the products' batch axes (n, k) lead, so XLA neither transposes nor
        # copies the [.., S] tensors. One softmax over the context and the block without joining them: the
        # block's part first (its maximum finite: every block slot sees the whole block), the context's parts
        # folded in (online softmax), the denominator applied after the products with the values.
        f32 = jnp.float32  # scores, sums and the unnormalised value products accumulate in float32 (a float16
        # product of S exponentials and values can pass 65504 before the division)
        s_blk = jnp.einsum("nbgkqe,nbhke->nkbgqh", q, kb, preferred_element_type=f32)  # [N, K, B, G, Q, G]
        # The softmax does not depend on the shift: no gradient flows through the maximum (exact, and it spares
        # the backward pass a compare-and-select over the whole score tensor).
        top = lax.stop_gradient(jnp.max(s_blk, axis=-1, keepdims=True))
        e_blk = jnp.exp(s_blk - top)
        carry = (top, jnp.sum(e_blk, axis=-1, keepdims=True),
                 jnp.einsum("nkbgqh,nbhke->nkbgqe", e_blk.astype(x.dtype), vb, preferred_element_type=f32))
        _, denom, acc = fold_context(q, carry)
        out = jnp.transpose(acc / denom, (0, 2, 3, 1, 4, 5)).astype(x.dtype)  # [N, B, G, K, Q, E]
        x = x + self.wo(out.reshape(N, B, G, H * E))
        h = self.mlp_norm(x)
        return x + self.w_down(jax.nn.silu(self.w_gate(h)) * self.w_up(h))


def _context_part(q, carry, ctx_k, ctx_v, visible):
    """Fold one part of the context into a block's softmax state: q [N, B, G, K, Q, E], ctx_k and ctx_v
    [N, S, K, E] (operands in the cache's dtype: a bf16 cache is never cast to float32), visible broadcastable
    to [N, K, B, G, Q, S]; carry (top, denom [N, K, B, G, Q, 1], acc [N, K, B, G, Q, E]) float32."""
    top, denom, acc = carry
    s_ctx = jnp.einsum("nbgkqe,nske->nkbgqs", q.astype(ctx_k.dtype), ctx_k, preferred_element_type=jnp.float32)
    top, denom, weights, keep = online_softmax_step(top, denom, s_ctx, visible)
    pv = jnp.einsum("nkbgqs,nske->nkbgqe", weights.astype(ctx_v.dtype), ctx_v, preferred_element_type=jnp.float32)
    return top, denom, acc * keep + pv


class Drafter(nnx.Module):
    """Backbone + sequential head + confidence head. Use the module functions below to run it."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, vocab_ids: np.ndarray | None = None):
        self.cfg = cfg
        D, W, r = cfg.dim, cfg.draft_vocab, cfg.rank
        if vocab_ids is None:
            vocab_ids = np.arange(W, dtype=np.int32)
        vocab_ids = np.asarray(vocab_ids, np.int32)
        if vocab_ids.shape != (W,) or np.any(np.diff(vocab_ids) <= 0) or vocab_ids[0] < 0 or vocab_ids[-1] >= cfg.vocab_size:
            raise ValueError(
                f"vocab_ids must be {W} strictly increasing token ids in [0, {cfg.vocab_size}), got shape "
                f"{vocab_ids.shape}"
            )
        to_draft = np.full(cfg.vocab_size, W, np.int32)  # W = "not in the draft vocabulary"
        to_draft[vocab_ids] = np.arange(W, dtype=np.int32)
        self.vocab_ids = Buffer(jnp.asarray(vocab_ids))  # [W] draft index -> token id
        self.to_draft = Buffer(jnp.asarray(to_draft))  # [V] token id -> draft index (W if absent)
        if cfg.tap_norm:
            # The target's layers differ in scale by 10x and more (the residual stream grows with depth, with a
            # few outlier dimensions); normalising each tap lets the projection weigh them on one scale.
            self.tap_scale = nnx.Param(jnp.ones((cfg.n_taps, D), jnp.float32))
        self.ctx_proj = nnx.Linear(cfg.n_taps * D, D, use_bias=False, kernel_init=_init(), rngs=rngs)
        self.ctx_norm = nnx.RMSNorm(D, epsilon=cfg.norm_eps, rngs=rngs)
        if cfg.mask_token is None:
            self.mask_embed = nnx.Param(_init()(rngs.params(), (D,)))
        self.layers = nnx.List([DraftLayer(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = nnx.RMSNorm(D, epsilon=cfg.norm_eps, rngs=rngs)
        if cfg.uses_prev_token:
            self.w1 = nnx.Embed(W + 1, r, embedding_init=_init(1.0 / np.sqrt(r)), rngs=rngs)
            if W == cfg.vocab_size:  # no token lies outside a full vocabulary: its shared row, never read, is zero
                self.w1.embedding[...] = self.w1.embedding[...].at[W].set(0.0)  # (as the checkpoint readers set it)
        if cfg.head != "none":
            # W2 starts at zero: the head starts as a plain DFlash drafter and learns the correction.
            self.w2 = nnx.Linear(r, W, use_bias=False, kernel_init=nnx.initializers.zeros, rngs=rngs)
        if cfg.head == "rnn":
            self.cell = nnx.Linear(2 * r + D, 3 * r, use_bias=True, kernel_init=_init(), rngs=rngs)
        if cfg.confidence:
            width = D + r if cfg.confidence_prev else D
            self.conf = nnx.Linear(width, 1, use_bias=True, kernel_init=_init(), rngs=rngs)
        if cfg.head == "gated":
            self.gate = nnx.Linear(D + r, r, use_bias=True, kernel_init=_init(), rngs=rngs)
        if cfg.own_embeddings:
            self.embed = nnx.Param(_init(1.0)(rngs.params(), (cfg.vocab_size, D)))  # [V, D]
            self.lm_head = nnx.Param(_init()(rngs.params(), (D, W)))  # [D, W] over the draft vocabulary

    # ------------------------------------------------------------------ backbone
    def context_features(self, taps: jax.Array) -> jax.Array:
        """H_ctx = RMSNorm(W_c [h_l1; ...; h_lM]): [..., M, D] -> [..., D] (with ``tap_norm``, each h_l is
        RMS-normalised and scaled by its own learned vector first)."""
        kernel = self.ctx_proj.kernel[...]  # [M * D, D]
        if self.cfg.tap_norm:
            t = taps.astype(jnp.float32)
            taps = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + self.cfg.norm_eps)
            scale = self.tap_scale[...]  # [M, D]
            if math.prod(taps.shape[:-2]) < kernel.shape[1]:  # fewer tokens than D: scale the [..., M, D] taps
                taps = taps * scale
            else:
                # (t * s) @ W as t @ (s * W): the same product, cheaper over many tokens, and the gradient of the
                # scale s is then read off the kernel's gradient ([M * D, D]) instead of a pass back over every
                # context token's taps. A round's few tokens would rewrite the whole kernel instead.
                kernel = (scale.reshape(-1, 1) * kernel.astype(jnp.float32)).astype(kernel.dtype)
        flat = taps.reshape(*taps.shape[:-2], -1).astype(kernel.dtype)
        return self.ctx_norm(flat @ kernel)

    def context_kv(self, taps: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-layer context keys and values: taps [..., M, D], positions [...] -> 2 x [L, ..., K, E]."""
        h_ctx = self.context_features(taps)
        kv = [layer.context_kv(h_ctx, positions) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    def hidden(self, ctx_k, ctx_v, ctx_mask, anchors, anchor_pos, embed):
        """Block hidden states.

        Args:
          ctx_k, ctx_v: [L, N, S, K, E] per-layer context keys and values.
          ctx_mask: bool [N, B, S] context visible to each block (strictly before its anchor).
          anchors: int [N, B] anchor token ids; anchor_pos: int [N, B] their positions.
          embed: [V, D] the frozen target embedding (unused with ``own_embeddings``).
        Returns:
          [N, B, G, D] final-normed hidden states h_k (slot k predicts x_{k+1}).
        """
        return self._hidden(anchors, anchor_pos, embed,
                            lambda i, layer, x, pos: layer(x, pos, ctx_k[i], ctx_v[i], ctx_mask))

    def layer_inputs(self, ctx_k, ctx_v, ctx_mask, anchors, anchor_pos, embed) -> list[jax.Array]:
        """The input of every draft layer over the blocks, [N, B, G, D] each (arguments as `hidden`): what
        statistics of the layers' activations read (`heads.fit_qk_norm_scales`)."""
        inputs = []

        def run_layer(i, layer, x, pos):
            inputs.append(x)
            return layer(x, pos, ctx_k[i], ctx_v[i], ctx_mask)

        self._hidden(anchors, anchor_pos, embed, run_layer)
        return inputs

    def hidden_cached(self, context: "CachedContext", anchors, anchor_pos, embed):
        """Block hidden states of one block per row, the context read from the drafter's cache in parts
        (`CachedContext`): anchors, anchor_pos int [N, 1] -> [N, 1, G, D] (as `hidden`)."""
        return self._hidden(anchors, anchor_pos, embed, lambda i, layer, x, pos: layer.cached(x, pos, context, i))

    def _hidden(self, anchors, anchor_pos, embed, run_layer):
        G = self.cfg.block
        table = self.embed[...] if self.cfg.own_embeddings else embed  # [V, D]
        dtype = self.ctx_proj.kernel[...].dtype
        mask = self.mask_embed[...] if self.cfg.mask_token is None else table[self.cfg.mask_token]  # [D]
        first = table[anchors].astype(dtype)[:, :, None, :]  # [N, B, 1, D]
        rest = jnp.broadcast_to(mask.astype(dtype), (*anchors.shape, G - 1, self.cfg.dim))
        x = jnp.concatenate([first, rest], axis=2)  # [N, B, G, D]
        positions = anchor_pos[..., None] + jnp.arange(G, dtype=jnp.int32)  # [N, B, G]
        for i, layer in enumerate(self.layers):
            x = run_layer(i, layer, x, positions)
        return self.final_norm(x)

    # ------------------------------------------------------------------ sequential and confidence heads
    def prev_embedding(self, prev_tokens: jax.Array) -> jax.Array:
        """W1[x] for token ids [...] -> [..., r] (tokens outside the draft vocabulary share one row)."""
        return self.w1(self.to_draft[...][prev_tokens])

    def head_step(self, h_k, e_prev, state):
        """Sequential-head bias and confidence logit at one slot.

        Args:
          h_k: [..., D] backbone hidden state of the slot; e_prev: [..., r] W1 of the previous token (None
            when no head reads it, `DrafterConfig.uses_prev_token`).
          state: [..., r] RNN state (ignored by the other heads).
        Returns:
          (bias [..., W] or None, confidence logit [...] or None, new state).
        """
        cfg = self.cfg
        bias = conf = None
        if cfg.head == "markov":
            bias = self.w2(e_prev)
        elif cfg.head == "gated":  # the hidden state gates the previous token's embedding
            gate = jax.nn.sigmoid(self.gate(jnp.concatenate([h_k, e_prev.astype(h_k.dtype)], axis=-1)))
            bias = self.w2(gate * e_prev)
        elif cfg.head == "rnn":
            r = cfg.rank
            z = self.cell(jnp.concatenate([state, e_prev, h_k], axis=-1))
            g, u, o = z[..., :r], z[..., r : 2 * r], z[..., 2 * r :]
            gate = jax.nn.sigmoid(g)
            state = gate * state + (1 - gate) * jnp.tanh(u)
            bias = self.w2(jnp.tanh(o))
        if cfg.confidence:
            feats = jnp.concatenate([h_k, e_prev.astype(h_k.dtype)], axis=-1) if cfg.confidence_prev else h_k
            conf = self.conf(feats)[..., 0]
        return bias, conf, state

    def teacher_forced(self, h: jax.Array, prev_tokens: jax.Array, head_w: jax.Array):
        """Corrected logits and confidence logits with the ground-truth previous tokens (training).

        Args:
          h: [..., G, D] hidden states; prev_tokens: int [..., G] token before each slot's target
            (x0 = the anchor for slot 0); head_w: [D, W] frozen LM head restricted to the draft vocabulary.
        Returns:
          logits float32 [..., G, W]; confidence logits float32 [..., G] (zeros without a confidence head).
        """
        logits = jnp.einsum("...gd,dw->...gw", h.astype(head_w.dtype), head_w, preferred_element_type=jnp.float32)
        if not self.cfg.sequential:
            return logits, proxy_confidence_logit(logits)
        e = self.prev_embedding(prev_tokens) if self.cfg.uses_prev_token else None  # [..., G, r]
        if self.cfg.head == "rnn":
            def step(state, xs):
                h_k, e_k = xs
                bias, conf, state = self.head_step(h_k, e_k, state)
                return state, (bias, conf if conf is not None else jnp.zeros(h_k.shape[:-1]))

            state0 = jnp.zeros((*h.shape[:-2], self.cfg.rank), h.dtype)
            _, (bias, conf) = lax.scan(step, state0, (jnp.moveaxis(h, -2, 0), jnp.moveaxis(e, -2, 0)))
            bias, conf = jnp.moveaxis(bias, 0, -2), jnp.moveaxis(conf, 0, -1)
        else:
            bias, conf, _ = self.head_step(h, e, None)
            conf = jnp.zeros(h.shape[:-1]) if conf is None else conf
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        if not self.cfg.confidence:
            conf = proxy_confidence_logit(logits)
        return logits, conf.astype(jnp.float32)


def proxy_confidence_logit(logits: jax.Array) -> jax.Array:
    """Confidence without a confidence head (a plain DFlash drafter): the logit of the slot's top
    probability at temperature 1. It depends on the earlier tokens only, never on the token drawn at the
    slot, so schedulers may use it without breaking losslessness. [..., W] -> [...]."""
    top = jnp.clip(jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1), 1e-6, 1 - 1e-6)
    return jnp.log(top) - jnp.log1p(-top)


# ---------------------------------------------------------------------------------------------------------
# Sampling a block: one lax.scan over the G slots for the whole batch.


def sample_block(drafter: Drafter, h: jax.Array, anchors: jax.Array, keys: jax.Array, temperature: jax.Array,
                 head_w: jax.Array):
    """Draw x1..xG left to right from the corrected distributions.

    Args:
      drafter: the module.
      h: [R, G, D] backbone hidden states.
      anchors: int [R] the anchor (last committed) tokens x0.
      keys: [R] PRNG keys, one per request (a row's draws do not depend on the rest of the batch).
      temperature: float [] or [R] (traced), one for all rows or one per row; 0 means greedy (one-hot
        distributions).
      head_w: [D, W] frozen LM head over the draft vocabulary.
    Returns:
      tokens int32 [R, G] (target token ids), probs float32 [R, G, W] (the exact distributions the tokens
      were drawn from, over the draft vocabulary), confidence logits float32 [R, G] (without a confidence
      head: the logit of each slot's top probability at temperature 1).
    """
    cfg = drafter.cfg
    R, G, _ = h.shape
    # [R, G, W]: the head an operand in its own dtype (no float32 copy of a [D, W] head), float32 accumulation
    base = jnp.einsum("rgd,dw->rgw", h.astype(head_w.dtype), head_w, preferred_element_type=jnp.float32)
    step_keys = jax.vmap(lambda k: jax.random.split(k, G))(keys)  # [R, G]
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (R,))[:, None]  # [R, 1]
    greedy = t <= 0

    def scan(sampling: bool):
        """The G slots left to right; ``sampling``: some row samples (else every row takes the argmax, and the
        softmax and the draw, which cost more than the rest of a step, are not computed)."""
        def step(carry, xs):
            prev, state = carry
            h_k, base_k, key_k = xs  # [R, D], [R, W], [R]
            if cfg.sequential:
                e_prev = drafter.prev_embedding(prev) if cfg.uses_prev_token else None
                bias, conf, state = drafter.head_step(h_k, e_prev, state)
            else:
                bias, conf = None, None
            logits = base_k if bias is None else base_k + bias.astype(jnp.float32)
            top = first_argmax(logits)  # [R]
            probs = jax.nn.one_hot(top, logits.shape[-1], dtype=jnp.float32)  # a greedy row's law
            idx = top.astype(jnp.int32)
            if sampling:
                probs = jnp.where(greedy, probs, jax.nn.softmax(logits / jnp.where(greedy, 1.0, t), axis=-1))
                idx = jnp.where(greedy[:, 0], idx, categorical(key_k, safe_log(probs))).astype(jnp.int32)
            token = drafter.vocab_ids[...][idx]
            if conf is None:
                conf = proxy_confidence_logit(logits)
            conf = conf.astype(jnp.float32)
            return (token, state), (token, probs, conf)

        state0 = jnp.zeros((R, cfg.rank), h.dtype)
        xs = (jnp.moveaxis(h, 1, 0), jnp.moveaxis(base, 1, 0), jnp.moveaxis(step_keys, 1, 0))
        return lax.scan(step, (anchors.astype(jnp.int32), state0), xs)[1]

    # one decision for the block (a constant temperature folds it away)
    tokens, probs, conf = lax.cond(jnp.all(greedy), lambda: scan(False), lambda: scan(True))
    return jnp.moveaxis(tokens, 0, 1), jnp.moveaxis(probs, 0, 1), jnp.moveaxis(conf, 0, 1)


# ---------------------------------------------------------------------------------------------------------
# The drafter's context cache at inference: projected K/V of committed tokens per draft layer.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrafterCache:
    """Context keys (after RoPE) and values per draft layer and slot.

    How many entries of a slot are valid is not stored here: it is the target's committed length for that
    slot (the anchor's position). Entries written for rejected tokens lie beyond it and get overwritten, so
    rolling back after verification costs nothing.
    """

    k: jax.Array  # [L, S, C, K, E]
    v: jax.Array  # [L, S, C, K, E]

    def replace(self, **kw) -> "DrafterCache":
        return dataclasses.replace(self, **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedDrafterCache:
    """The drafter's context keys and values in pages that follow the target's: page ``p`` of the target's
    pool and of this one hold the same positions of the same request, so one block table (the target cache's)
    finds both, and a request's pages carry its drafter context wherever they go."""

    k: jax.Array  # [L, P, ps, K, E]
    v: jax.Array  # [L, P, ps, K, E]

    def replace(self, **kw) -> "PagedDrafterCache":
        return dataclasses.replace(self, **kw)


def init_drafter_cache(cfg: DrafterConfig, num_slots: int, capacity: int, dtype=jnp.float32) -> DrafterCache:
    shape = (cfg.n_layers, num_slots, capacity, cfg.n_kv_heads, cfg.head_dim)
    return DrafterCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def init_paged_drafter_cache(cfg: DrafterConfig, num_pages: int, page_size: int, dtype=jnp.float32
                             ) -> PagedDrafterCache:
    """An empty paged drafter cache of ``num_pages`` pages of ``page_size`` positions (the target's pool's)."""
    shape = (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
    return PagedDrafterCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write_context(drafter: Drafter, cache: DrafterCache | PagedDrafterCache, taps, slots, positions, valid,
                  block_tables: jax.Array | None = None) -> DrafterCache | PagedDrafterCache:
    """Append the context K/V of verified (or prefilled) tokens.

    Args:
      taps: [T, M, D] target tapped hidden states of the tokens; slots, positions: int [T]; valid: bool [T].
      block_tables: int [S, N] the target cache's block table (a `PagedDrafterCache` only).
    Returns:
      the cache with K/V written at (slot, position) for valid tokens.
    """
    k, v = drafter.context_kv(taps, positions)  # [L, T, K, E]
    if isinstance(cache, PagedDrafterCache):
        L, P, ps = cache.k.shape[:3]
        S, N = block_tables.shape
        page = positions // ps
        ok = valid & (page < N)
        flat = block_tables[jnp.clip(slots, 0, S - 1), jnp.clip(page, 0, N - 1)] * ps + positions % ps
        flat = jnp.where(ok, flat, P * ps)  # out of range: dropped
        put = lambda c, x: c.reshape(L, P * ps, *c.shape[3:]).at[:, flat].set(x.astype(c.dtype), mode="drop"
                                                                              ).reshape(c.shape)
        return cache.replace(k=put(cache.k, k), v=put(cache.v, v))
    S = cache.k.shape[1]
    write = jnp.where(valid, slots, S)  # out of range: dropped
    return cache.replace(
        k=cache.k.at[:, write, positions].set(k.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[:, write, positions].set(v.astype(cache.v.dtype), mode="drop"),
    )


class CachedContext:
    """The drafter's context cache as the rows of a draft read it: layer by layer, in parts up to the rows'
    longest context (`llama.over_context`; one program for every context), or over a static window.

    Args:
      cache: a `DrafterCache` or `PagedDrafterCache`.
      rows: int [N] the rows' slots, or None: every slot in slot order, read in place (dense cache).
      ctx_len: int [N] each row sees the positions below its own.
      block_tables: int [S, Np] the target cache's block table (a `PagedDrafterCache` only).
      context: optional static bound >= every ctx_len: one part over positions below it instead.
    """

    def __init__(self, cache, rows, ctx_len, block_tables=None, context: int | None = None):
        self.cache, self.rows, self.ctx_len = cache, rows, ctx_len
        self.paged = isinstance(cache, PagedDrafterCache)
        if self.paged:
            self.unit = cache.k.shape[2]
            self.tables = block_tables if rows is None else block_tables[rows]  # [N, Np]
            capacity = self.tables.shape[1] * self.unit
        else:
            self.unit, capacity = 1, cache.k.shape[2]
        self.static = context is not None
        self.span = capacity if context is None else min(-(-int(context) // self.unit) * self.unit, capacity)
        self.bound = jnp.max(ctx_len)

    def read(self, layer: int, start, size: int):
        """Keys and values [N, size, K, E] of layer ``layer`` at positions [start, start + size)."""
        k, v = self.cache.k, self.cache.v
        if self.paged:
            pages = lax.dynamic_slice_in_dim(self.tables, start // self.unit, size // self.unit, axis=1)  # [N, n]
            return tuple(c[layer, pages].reshape(pages.shape[0], size, *c.shape[3:]) for c in (k, v))
        _, S, _, K, E = k.shape
        if self.rows is None:
            return tuple(lax.dynamic_slice(c, (layer, 0, start, 0, 0), (1, S, size, K, E))[0] for c in (k, v))
        return tuple(jax.vmap(lambda r, c=c: lax.dynamic_slice(c, (layer, r, start, 0, 0), (1, 1, size, K, E))[0, 0])(
            self.rows) for c in (k, v))

    def fold(self, layer: int, q, carry):
        """Fold every part of layer ``layer``'s context into a block's softmax state (`_context_part`)."""
        def part(read, start, size, carry):
            ctx_k, ctx_v = self.read(layer, read, size)
            pos = read + jnp.arange(size, dtype=jnp.int32)
            visible = (pos[None, :] < self.ctx_len[:, None]) & (pos >= start)  # [N, size]
            return _context_part(q, carry, ctx_k, ctx_v, visible[:, None, None, None, None, :])

        return over_context(part, carry, self.bound, self.span, unit=self.unit, static=self.static)


def draft(drafter: Drafter, cache: DrafterCache | PagedDrafterCache, slots, ctx_len, anchors, keys, temperature,
          embed, head_w, context: int | None = None, block_tables: jax.Array | None = None):
    """Draft one block for each of R requests (one backbone pass, then the sequential scan).

    Args:
      cache: the drafter cache; slots: int [R] the requests' slots (any value for padding rows), or None: every
        slot in slot order (R = S), read in place.
      ctx_len: int [R] committed tokens of each slot (= the anchor's position).
      anchors: int [R] anchor tokens; keys: [R] PRNG keys; temperature: float [] or [R] (per row).
      embed: [V, D] frozen target embedding; head_w: [D, W] frozen LM head over the draft vocabulary.
      context: optional static bound >= every ctx_len: only cache positions below it are read, in one part;
        None: the cache is read in parts up to the longest ctx_len (`CachedContext`).
      block_tables: int [S, N] the target cache's block table (a `PagedDrafterCache` only).
    Returns:
      tokens int32 [R, G], probs float32 [R, G, W], confidence logits float32 [R, G].
    """
    ctx = CachedContext(cache, slots, ctx_len, block_tables, context)
    h = drafter.hidden_cached(ctx, anchors[:, None], ctx_len[:, None], embed)[:, 0]  # [R, G, D]
    return sample_block(drafter, h, anchors, keys, temperature, head_w)


def draft_head_weights(drafter: Drafter, embed: jax.Array, lm_head: jax.Array | None = None) -> jax.Array:
    """The frozen LM head restricted to the draft vocabulary: [D, W] (the drafter's own copy with
    ``own_embeddings``)."""
    if drafter.cfg.own_embeddings:
        return drafter.lm_head[...]
    ids = drafter.vocab_ids[...]
    if lm_head is None:  # tied embeddings
        return embed[ids].T
    return lm_head[:, ids]


def expand_draft_probs(probs: jax.Array, vocab_ids: jax.Array, vocab_size: int) -> jax.Array:
    """Distributions over the draft vocabulary [..., W] -> over the target vocabulary [..., V] (zeros
    outside the draft vocabulary)."""
    if probs.shape[-1] == vocab_size:
        return probs
    out = jnp.zeros((*probs.shape[:-1], vocab_size), probs.dtype)
    return out.at[..., vocab_ids].set(probs)
