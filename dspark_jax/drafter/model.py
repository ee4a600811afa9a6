"""The DSpark / DFlash drafter: backbone + LM head + sequential head + confidence head.

The target's embedding and LM head are *arguments*, never drafter parameters: they are frozen
and shared (spec §1.1), so a drafter checkpoint does not carry them and gradients cannot reach
them. An optional reduced LM head over the top-N target tokens (EAGLE-3 / speculators style)
replaces the full head; it is trainable, initialised from the target head's rows, and its draft
index ``i`` means target token ``d2t[i]``. Tokens outside it get probability 0 under the draft
distribution, which verification handles like any other zero of ``q``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafter.backbone import Backbone, ContextCache
from dspark_jax.drafter.heads import (
    DraftBlock,
    make_confidence_head,
    make_markov_head,
    sample_block,
)
from dspark_jax.models.layers import Linear, project
from dspark_jax.sampling import SamplingParams


class DraftVocab(nnx.Variable):
    """The reduced head's draft-index -> target-id map (data, not a trainable parameter)."""


def select_draft_vocab(token_counts_V: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent target tokens, ascending by id (ties broken by lower id)."""
    counts = np.asarray(token_counts_V)
    if not 0 < size <= counts.shape[0]:
        raise ValueError(f"draft vocabulary size must be in (0, {counts.shape[0]}], got {size}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))
    return np.sort(order[:size]).astype(np.int32)


class ReducedHead(nnx.Module):
    """A trainable LM head over ``N`` chosen target tokens; draft index ``i`` is token ``d2t[i]``."""

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_ids, *, rngs: nnx.Rngs, dtype=jnp.float32):
        ids = np.asarray(draft_vocab_ids if draft_vocab_ids is not None else [], np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"a reduced head needs a 1-D array of draft_vocab_ids, got shape {ids.shape}")
        if len(np.unique(ids)) != ids.size or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"draft_vocab_ids must be distinct target ids in [0, {vocab_size})")
        self.d2t = DraftVocab(jnp.asarray(ids, jnp.int32))
        self.linear = Linear(hidden_size, ids.size, rngs=rngs, dtype=dtype)

    @property
    def d2t_N(self) -> jax.Array:
        return self.d2t[...]

    def init_from(self, lm_head_VxD: jax.Array) -> None:
        """Start from the target head's rows for the draft tokens."""
        self.linear.weight[...] = jnp.asarray(lm_head_VxD)[self.d2t[...]].astype(self.linear.weight.dtype)

    def __call__(self, h_xd: jax.Array) -> jax.Array:
        return self.linear(h_xd).astype(jnp.float32)


def make_reduced_head(cfg: DrafterConfig, draft_vocab_ids, rngs: nnx.Rngs, dtype) -> ReducedHead | None:
    """The config's reduced head, or None for a full-vocabulary drafter."""
    if cfg.draft_vocab_size is None:
        if draft_vocab_ids is not None:
            raise ValueError("draft_vocab_ids given but the config has no draft_vocab_size")
        return None
    ids = np.asarray(draft_vocab_ids if draft_vocab_ids is not None else [], np.int64)
    if ids.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"a reduced head needs draft_vocab_ids of shape ({cfg.draft_vocab_size},), got {ids.shape}")
    return ReducedHead(cfg.hidden_size, cfg.vocab_size, ids, rngs=rngs, dtype=dtype)


class ReducedHeadMixin:
    """``init_draft_head`` / ``d2t_N`` for a drafter whose ``draft_head`` is a ReducedHead or None."""

    draft_head: ReducedHead | None

    def init_draft_head(self, lm_head_VxD: jax.Array) -> None:
        """Start the reduced head from the target head's rows for the draft tokens."""
        if self.draft_head is None:
            raise ValueError("this drafter has no reduced head")
        self.draft_head.init_from(lm_head_VxD)

    @property
    def d2t_N(self) -> jax.Array | None:
        return None if self.draft_head is None else self.draft_head.d2t_N


class Drafter(ReducedHeadMixin, nnx.Module):
    def __init__(
        self,
        cfg: DrafterConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        draft_vocab_ids: np.ndarray | None = None,
    ):
        if cfg.kind == "eagle3":
            raise ValueError("an eagle3 config builds an Eagle3Drafter (dspark_jax.drafter.eagle3)")
        self.cfg = cfg
        self.backbone = Backbone(cfg, rngs=rngs, dtype=dtype)
        self.draft_head = make_reduced_head(cfg, draft_vocab_ids, rngs, dtype)
        if cfg.markov_w1_rows == "draft" and np.any(np.diff(np.asarray(draft_vocab_ids)) <= 0):
            raise ValueError("markov_w1_rows='draft' needs draft_vocab_ids in ascending order (W1 rows follow them)")
        self.markov = make_markov_head(cfg, rngs, dtype, None if self.draft_head is None else self.draft_head.d2t)
        self.confidence = make_confidence_head(cfg, rngs, dtype)

    def base_logits(self, h_xd: jax.Array, lm_head_VxD: jax.Array) -> jax.Array:
        """``U = head(h)`` over the draft vocabulary (the full target vocab without a reduced head)."""
        if self.draft_head is not None:
            return self.draft_head(h_xd)
        return project(h_xd, jax.lax.stop_gradient(lm_head_VxD)).astype(jnp.float32)

    def teacher_forced(self, h_xGxd, lm_head_VxD, prev_tokens_xG):
        """Training outputs for blocks with known previous tokens ``[anchor, x*_1..x*_{γ−1}]``:
        Markov-corrected logits ``[..., γ, N]`` and confidence logits ``[..., γ]`` (or None)."""
        logits = self.base_logits(h_xGxd, lm_head_VxD)
        if self.markov is not None:
            logits = logits + self.markov.block_bias(h_xGxd, prev_tokens_xG).astype(jnp.float32)
        confidence = None
        if self.confidence is not None:
            confidence = self.confidence(h_xGxd, prev_tokens_xG, self.markov)
        return logits, confidence

    # The SpeculativeDrafter interface (dspark_jax.drafter.interface).

    def new_context(self, batch: int, max_len: int, dtype=jnp.float32) -> ContextCache:
        return ContextCache.create(self.cfg, batch, max_len, dtype)

    def extend_context(self, embed_VxD, context: ContextCache, features_BxTxF, next_tokens_BxT, n_new_B):
        """Context rows are features only: the tokens reach a block through its anchor."""
        return self.backbone.extend_context(context, features_BxTxF, n_new_B)

    def propose(
        self,
        embed_VxD: jax.Array,
        lm_head_VxD: jax.Array,
        cache: ContextCache,
        anchor_B: jax.Array,
        params: SamplingParams,
        keys_BxG: jax.Array,
    ) -> tuple[DraftBlock, jax.Array | None]:
        """One round's proposal after ``cache``: the sampled block and per-slot confidence logits."""
        h = self.backbone.forward_block(embed_VxD, cache, anchor_B)
        block = sample_block(
            self.markov, self.base_logits(h, lm_head_VxD), h, anchor_B, params, keys_BxG,
            d2t_N=self.d2t_N, vocab_size=self.cfg.vocab_size,
        )
        confidence = None
        if self.confidence is not None:
            confidence = self.confidence(h, block.prev_tokens_BxG, self.markov)
        return block, confidence

    @property
    def num_params(self) -> int:
        return int(sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param))))

    def deepened(self, num_layers: int, *, seed: int = 0) -> Drafter:
        """This drafter with new layers appended after its own, every trained weight kept.

        The new layers' residual branches end in zeros (attention ``o`` and MLP ``down``), so they
        add nothing: the deeper drafter drafts exactly as this one until training moves them
        (function-preserving growth). Their other weights get the usual random init, which is
        what lets the first step's gradient reach ``o`` and ``down``.
        """
        have = self.cfg.backbone.num_layers
        if num_layers <= have:
            raise ValueError(f"a deeper drafter needs more than this one's {have} layers, got {num_layers}")
        cfg = dataclasses.replace(self.cfg, backbone=dataclasses.replace(self.cfg.backbone, num_layers=num_layers))
        dtype = self.backbone.fc.weight[...].dtype
        deeper = Drafter(cfg, rngs=nnx.Rngs(seed), dtype=dtype,
                         draft_vocab_ids=None if self.draft_head is None else np.asarray(self.d2t_N))
        nnx.update(deeper, nnx.state(self))  # every variable this drafter has, layers 0..have-1 included
        for layer in deeper.backbone.layers[have:]:
            layer.o.weight[...] = jnp.zeros_like(layer.o.weight[...])
            layer.mlp.down.weight[...] = jnp.zeros_like(layer.mlp.down.weight[...])
        return deeper

    def gated_markov(self) -> Drafter:
        """This drafter with its vanilla Markov head turned into a gated one (spec §2.2), all else kept.

        The gate starts with zero weights and bias, so it is σ(0) = ½ for every input, and ``W2``
        is doubled: ``2·W2 (½ ⊙ W1[x]) = W2 W1[x]`` exactly (both factors are powers of two), so
        the drafter drafts and scores exactly as before until training moves the gate. Its
        gradient is not zero at the start, so the first step already makes it depend on ``h``.
        """
        old = self.markov
        if old is None or old.kind != "vanilla":
            raise ValueError("only a vanilla Markov head can be turned into a gated one")
        cfg = dataclasses.replace(self.cfg, markov_head="gated")
        dtype = self.backbone.fc.weight[...].dtype
        gated = Drafter(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                        draft_vocab_ids=None if self.draft_head is None else np.asarray(self.d2t_N))
        nnx.update(gated, nnx.state(self))  # every variable but the new gate
        gated.markov.gate.weight[...] = jnp.zeros_like(gated.markov.gate.weight[...])
        gated.markov.gate.bias[...] = jnp.zeros_like(gated.markov.gate.bias[...])
        gated.markov.w2.weight[...] = 2 * old.w2.weight[...]
        return gated

    def widened_markov(self, rank: int, *, w1_rows: str | None = None, seed: int = 0) -> Drafter:
        """This drafter with a wider vanilla Markov head (and ``W1`` rows ``w1_rows``), all else kept.

        The old ``W1`` columns are kept and the new ones start random; the new ``W2`` columns and
        the confidence weights on the new ``W1`` columns start at zero, so the drafter drafts and
        scores exactly as before (function-preserving), except after an anchor outside the draft
        vocabulary when ``w1_rows`` turns target rows into draft rows: those ids then share one
        row, the mean of the rows they had.
        """
        old = self.markov
        if old is None or old.kind != "vanilla":
            raise ValueError("only a vanilla Markov head can be widened (gated and RNN heads mix W1 with h)")
        w1_rows = self.cfg.markov_w1_rows if w1_rows is None else w1_rows
        if rank < old.rank or (rank == old.rank and w1_rows == self.cfg.markov_w1_rows):
            raise ValueError(f"a wider Markov head needs a rank above this one's {old.rank} (or new W1 rows), got {rank}")
        if w1_rows == "target" and self.cfg.markov_w1_rows == "draft":
            raise ValueError("draft W1 rows cannot be turned back into target rows (the shared row has no per-token values)")
        cfg = dataclasses.replace(self.cfg, markov_rank=rank, markov_w1_rows=w1_rows)
        dtype = self.backbone.fc.weight[...].dtype
        wider = Drafter(cfg, rngs=nnx.Rngs(seed), dtype=dtype,
                        draft_vocab_ids=None if self.draft_head is None else np.asarray(self.d2t_N))
        kept = nnx.state(self)
        del kept["markov"]
        if self.confidence is not None:
            del kept["confidence"]
        nnx.update(wider, kept)
        w1 = old.w1[...]
        if w1_rows != self.cfg.markov_w1_rows:  # target rows -> draft rows
            d2t = self.d2t_N
            others = jnp.ones((w1.shape[0],), bool).at[d2t].set(False)
            shared = jnp.sum(jnp.where(others[:, None], w1, 0), axis=0) / jnp.sum(others)
            w1 = jnp.concatenate([w1[d2t], shared[None].astype(w1.dtype)])
        r = old.rank
        wider.markov.w1[...] = wider.markov.w1[...].at[:, :r].set(w1)
        wider.markov.w2.weight[...] = jnp.zeros_like(wider.markov.w2.weight[...]).at[:, :r].set(old.w2.weight[...])
        if self.confidence is not None:
            old_w, width = self.confidence.proj.weight[...], self.confidence.proj.weight.shape[1]
            wider.confidence.proj.weight[...] = (
                jnp.zeros_like(wider.confidence.proj.weight[...]).at[:, :width].set(old_w))
            if self.confidence.proj.bias is not None:
                wider.confidence.proj.bias[...] = self.confidence.proj.bias[...]
        return wider
