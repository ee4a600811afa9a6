"""DSpark training losses (spec §3.2, §4; DeepSpec ``deepspec/modeling/dspark/loss.py``).

Per supervised slot ``s`` of a block (anchor ``a``, label index ``a + s + 1``):

* ``CE``: cross-entropy of the Markov-corrected draft logits ``Ũ`` against the ground-truth
  label (§4.2);
* ``TV``: ``‖p_d − p_t‖₁`` — the L1 distance, i.e. 2×TV, as in the code; ``cfg.tv_half``
  gives the paper's ``½‖·‖₁`` (§4.3). Both softmaxes are float32 over the full target vocab;
* ``BCE``: BCE-with-logits of the confidence logit against the DETACHED soft label
  ``c* = clamp(1 − ½‖p_d − p_t‖₁, 0, 1)`` (always with the ½, independent of ``tv_half``).

Every term is weighted by ``w = exp(−s / position_decay) · mask`` and normalised as
``Σ w·ℓ / Σ w`` (0 when ``Σ w = 0``). :func:`block_losses` returns only additive sums
(numerators, denominators, counts), so callers can add them over anchor chunks, micro-batches
or devices (``psum``) before :func:`combine` divides — the global token-weighted mean of §4.5.

The ``[anchors, γ, V]`` logits dominate memory (§10.12); :func:`chunked_block_losses` scans
over anchor chunks with rematerialisation so neither pass holds more than one chunk of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.eval.metrics import expected_tau
from dspark_jax.models.layers import project, take_per_row

# Names of the three loss terms, in combination order.
TERMS = ("ce", "tv", "conf")


# --------------------------------------------------------------------------------------------
# Weights and masks
# --------------------------------------------------------------------------------------------


def position_weights(gamma: int, decay: float = 4.0) -> jnp.ndarray:
    """``[γ]`` float32 weights ``exp(−s / decay)`` for slots ``s = 0 … γ−1`` (§4.1)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if not decay > 0:
        raise ValueError(f"decay must be > 0, got {decay}")
    return jnp.exp(-jnp.arange(gamma, dtype=jnp.float32) / jnp.float32(decay))


def supervision_mask(label_valid: jnp.ndarray) -> jnp.ndarray:
    """Cumulative product along the last (slot) axis: only a contiguous valid prefix survives.

    ``label_valid`` is ``...xG`` (bool or 0/1); returns a bool ``...xG`` mask.
    """
    valid = jnp.asarray(label_valid) != 0
    return jnp.cumprod(valid.astype(jnp.int32), axis=-1).astype(bool)


def _label_indices(anchors: jnp.ndarray, gamma: int) -> jnp.ndarray:
    """``[B, A, G]`` label indices ``a + s + 1``."""
    return anchors[..., None].astype(jnp.int32) + 1 + jnp.arange(gamma, dtype=jnp.int32)


def _gather_along_seq(values_BxSx: jnp.ndarray, idx_BxAxG: jnp.ndarray) -> jnp.ndarray:
    """``values[b, idx[b, a, g], ...]`` -> ``[B, A, G, ...]``, indices clamped into the sequence."""
    return take_per_row(values_BxSx, jnp.clip(idx_BxAxG, 0, values_BxSx.shape[1] - 1))


def block_label_mask(
    loss_mask_BxS: jnp.ndarray, anchors_BxA: jnp.ndarray, keep_BxA: jnp.ndarray, gamma: int
) -> jnp.ndarray:
    """DeepSpec's ``eval_mask`` (§4.1): ``[B, A, G]`` bool supervision mask.

    Slot ``s`` of anchor ``a`` is valid iff its label index ``a + s + 1 < S``, ``loss_mask`` there
    is 1, and the block is kept; the result is then cumulative-producted along ``s``.
    """
    seq_len = loss_mask_BxS.shape[1]
    idx = _label_indices(anchors_BxA, gamma)
    in_seq = idx < seq_len
    on_loss = _gather_along_seq(loss_mask_BxS, idx) != 0
    kept = (jnp.asarray(keep_BxA) != 0)[..., None]
    return supervision_mask(in_seq & on_loss & kept)


def block_labels(input_ids_BxS: jnp.ndarray, anchors_BxA: jnp.ndarray, gamma: int) -> jnp.ndarray:
    """``[B, A, G]`` ground-truth labels ``input_ids[a + s + 1]``, index clamped into the sequence.

    Slots whose index was clamped are not real labels; :func:`block_label_mask` masks them.
    """
    return _gather_along_seq(input_ids_BxS, _label_indices(anchors_BxA, gamma))


# --------------------------------------------------------------------------------------------
# Per-term sums
# --------------------------------------------------------------------------------------------


def _sum_lead(x: jnp.ndarray) -> jnp.ndarray:
    """Sum ``...xG`` over every axis but the last, giving ``[G]``."""
    return jnp.sum(x.reshape(-1, x.shape[-1]), axis=0)


def _check_d2t(d2t_N, n: int, v: int) -> jnp.ndarray | None:
    if d2t_N is None:
        if n != v:
            raise ValueError(
                f"draft logits have {n} classes but target logits {v}: a reduced draft vocabulary "
                "needs d2t_N (the target id of every draft index)"
            )
        return None
    d2t = jnp.asarray(d2t_N)
    if d2t.ndim != 1 or d2t.shape[0] != n:
        raise ValueError(f"d2t_N must have shape [{n}] (one target id per draft index), got {d2t.shape}")
    if not jnp.issubdtype(d2t.dtype, jnp.integer):
        raise ValueError(f"d2t_N must hold integer target ids, got dtype {d2t.dtype}")
    return d2t.astype(jnp.int32)


def block_losses(
    draft_logits: jnp.ndarray,
    target_logits: jnp.ndarray,
    labels: jnp.ndarray,
    mask: jnp.ndarray,
    confidence_logits: jnp.ndarray | None,
    cfg: Any,
    d2t_N: jnp.ndarray | None = None,
    target_lse: jnp.ndarray | None = None,
) -> dict[str, jnp.ndarray]:
    """Additive loss sums for a set of blocks.

    Args:
      draft_logits: ``...xGxN`` Markov-corrected draft logits ``Ũ`` (any float dtype; math is f32).
      target_logits: ``...xGxV`` target logits at the same labels (T = 1, untempered); with
        ``target_lse`` given, ``...xGxN`` target logits over the draft vocabulary only.
      target_lse: ``...xG`` the target's full-vocabulary ``logsumexp`` at each slot, or ``None``.
        With it the target's in-vocabulary probabilities are ``exp(logit − lse)`` and its mass
        outside the draft vocabulary is ``1 − Σ`` of those — the same loss as the full logits
        give, without the ``[..., V]`` product.
      labels: ``...xG`` int ground-truth tokens, TARGET-vocabulary ids.
      mask: ``...xG`` supervision mask (bool or 0/1), e.g. from :func:`block_label_mask`.
      confidence_logits: ``...xG`` confidence-head logits, or ``None`` (no confidence term).
      cfg: a ``DrafterConfig`` (uses ``position_decay`` and ``tv_half``).
      d2t_N: ``[N]`` int, the target id of each draft-vocab index (distinct ids) when the draft
        head covers only ``N < V`` tokens; ``None`` when ``N == V`` (identity).

    Returns a dict of float32 sums (all additive across chunks/devices):
      ``{ce,tv,conf}_num`` / ``{ce,tv,conf}_den``: ``Σ w·ℓ`` and ``Σ w`` per term. ``ce_den``
        excludes slots whose label is outside the draft vocab (they cannot be learned);
      ``ce_excluded``: how many supervised slots were dropped from CE for that reason;
      ``supervised``: number of supervised slots (``Σ mask``);
      ``accept_num`` / ``slot_count``: ``[G]`` sums of ``c*·mask`` and ``mask`` (accept_rate@s);
      ``tau_num`` / ``blocks``: ``Σ`` over blocks with ≥1 supervised slot of
        ``1 + Σ_k Π_{i≤k} c*_i·mask_i`` (``tau_probabilistic``), and the number of such blocks;
      ``greedy_prefix_num`` / ``greedy_reach_num``: ``[G]`` greedy-acceptance sums (see
        :func:`acceptance_sums`);
      ``conf_abs_err_num`` / ``conf_bias_num`` / ``conf_cumprod_bias_num``: ``Σ w·|σ(z)−c*|``,
        ``Σ w·(σ(z)−c*)``, ``Σ w·(Πσ(z) − Πc*)`` (normalise by ``conf_den``, as DeepSpec does);
        zero when there is no confidence head.
    """
    n = draft_logits.shape[-1]
    v = cfg.vocab_size if target_lse is not None else target_logits.shape[-1]
    gamma = draft_logits.shape[-2]
    if draft_logits.shape[:-1] != target_logits.shape[:-1]:
        raise ValueError(
            f"draft logits {draft_logits.shape} and target logits {target_logits.shape} disagree "
            "on their leading (block, slot) axes"
        )
    lead = draft_logits.shape[:-1]
    if labels.shape != lead or mask.shape != lead:
        raise ValueError(f"labels {labels.shape} and mask {mask.shape} must have shape {lead}")
    if confidence_logits is not None and confidence_logits.shape != lead:
        raise ValueError(f"confidence logits {confidence_logits.shape} must have shape {lead}")
    if target_lse is not None and (target_lse.shape != lead or target_logits.shape[-1] != n):
        raise ValueError(
            f"with target_lse {target_lse.shape}, target logits {target_logits.shape} must cover the "
            f"draft vocabulary ({n}) and the lse must have shape {lead}"
        )
    d2t = _check_d2t(d2t_N, n, v)

    m = (jnp.asarray(mask) != 0).astype(jnp.float32)
    w = position_weights(gamma, cfg.position_decay) * m  # ...xG

    # --- distributions (f32) ---
    draft_logp = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)  # ...xGxN
    p_d = jnp.exp(draft_logp)

    # --- L1 distance over the full target vocab ---
    if target_lse is not None:
        p_t_in = jnp.exp(target_logits.astype(jnp.float32) - target_lse.astype(jnp.float32)[..., None])
        outside = jnp.clip(1.0 - jnp.sum(p_t_in, axis=-1), 0.0, 1.0)
        l1 = jnp.sum(jnp.abs(p_d - p_t_in), axis=-1) + outside
    elif d2t is None:
        p_t = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)  # ...xGxV
        l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    else:
        # p_d scattered into V through d2t: Σ_n |p_d[n] − p_t[d2t[n]]| + (p_t mass outside d2t).
        p_t = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)  # ...xGxV
        p_t_in = jnp.take(p_t, d2t, axis=-1)  # ...xGxN
        outside = jnp.ones((v,), jnp.float32).at[d2t].set(0.0)
        l1 = jnp.sum(jnp.abs(p_d - p_t_in), axis=-1) + jnp.sum(p_t * outside, axis=-1)
    tv = 0.5 * l1 if cfg.tv_half else l1

    # --- cross-entropy against the ground-truth label (draft-vocab index) ---
    labels = jnp.asarray(labels).astype(jnp.int32)
    if d2t is None:
        draft_label = jnp.clip(labels, 0, n - 1)
        in_vocab = jnp.ones(lead, jnp.float32)
    else:
        t2d = jnp.full((v,), -1, jnp.int32).at[d2t].set(jnp.arange(n, dtype=jnp.int32))
        mapped = t2d[jnp.clip(labels, 0, v - 1)]
        in_vocab = ((mapped >= 0) & (labels >= 0) & (labels < v)).astype(jnp.float32)
        draft_label = jnp.maximum(mapped, 0)
    ce = -jnp.take_along_axis(draft_logp, draft_label[..., None], axis=-1)[..., 0]
    w_ce = w * in_vocab

    # --- confidence soft label (always ½ L1; detached) ---
    c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))

    out = {
        "ce_num": jnp.sum(w_ce * ce),
        "ce_den": jnp.sum(w_ce),
        "ce_excluded": jnp.sum(m * (1.0 - in_vocab)),
        "tv_num": jnp.sum(w * tv),
        "tv_den": jnp.sum(w),
        "supervised": jnp.sum(m),
        **acceptance_sums(c_star, draft_argmax_ids(draft_logits, d2t) == labels, m),
    }

    if confidence_logits is None:
        zero = jnp.zeros((), jnp.float32)
        out.update(conf_num=zero, conf_den=zero, conf_abs_err_num=zero, conf_bias_num=zero,
                   conf_cumprod_bias_num=zero)
    else:
        z = confidence_logits.astype(jnp.float32)
        # Stable BCE-with-logits: max(z, 0) − z·c + log(1 + e^{−|z|}).
        bce = jnp.maximum(z, 0.0) - z * c_star + jnp.log1p(jnp.exp(-jnp.abs(z)))
        out["conf_num"] = jnp.sum(w * bce)
        out["conf_den"] = jnp.sum(w)
        pred = jax.lax.stop_gradient(jax.nn.sigmoid(z))
        # Weighted like the BCE, as DeepSpec logs them, so the numbers compare with its runs.
        out["conf_abs_err_num"] = jnp.sum(w * jnp.abs(pred - c_star))
        out["conf_bias_num"] = jnp.sum(w * (pred - c_star))
        out["conf_cumprod_bias_num"] = jnp.sum(
            w * (jnp.cumprod(pred, axis=-1) - jnp.cumprod(c_star, axis=-1))
        )
    return out


def draft_argmax_ids(draft_logits: jnp.ndarray, d2t: jnp.ndarray | None) -> jnp.ndarray:
    """The target id of each slot's most likely draft token: what a greedy drafter proposes."""
    best = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)
    return best if d2t is None else d2t[best]


def acceptance_sums(accept: jnp.ndarray, greedy_hit: jnp.ndarray, mask: jnp.ndarray) -> dict[str, jnp.ndarray]:
    """Additive sums of the analytic acceptance metrics of blocks ``...xG`` (teacher-forced).

    ``accept`` is each slot's speculative-sampling acceptance at T = 1, ``Σ min(p_d, p_t)``;
    ``greedy_hit`` whether the draft's argmax is the label — greedy verification's acceptance
    when the labels are the target's greedy answers (on sampled answers it scores agreement
    with the sampled token); ``mask`` the cumulative supervision mask. Both chains stop at a
    block's last supervised slot, and every τ is averaged over blocks whose slot 0 is supervised.

    Returns ``accept_num`` / ``slot_count`` (``[G]``), ``tau_num`` / ``blocks``, and for greedy
    acceptance ``greedy_prefix_num`` (``[G]``: blocks whose slots ``0…k`` all hit) and
    ``greedy_reach_num`` (``[G]``: blocks that reach slot ``k`` with ``0…k−1`` all hit).
    """
    m = (jnp.asarray(mask) != 0).astype(jnp.float32)
    block_valid = m[..., 0]  # cumulative mask: a block is supervised iff its slot 0 is
    prefix = jnp.cumprod(greedy_hit.astype(jnp.float32) * m, axis=-1)
    reached = m * jnp.concatenate([jnp.ones_like(prefix[..., :1]), prefix[..., :-1]], axis=-1)
    return {
        "accept_num": _sum_lead(accept * m),
        "slot_count": _sum_lead(m),
        "tau_num": jnp.sum(expected_tau(accept * m) * block_valid),
        "blocks": jnp.sum(block_valid),
        "greedy_prefix_num": _sum_lead(prefix),
        "greedy_reach_num": _sum_lead(reached),
    }


def acceptance_metrics(parts: dict[str, jnp.ndarray]) -> dict[str, jnp.ndarray]:
    """Means of :func:`acceptance_sums` (possibly summed over chunks / devices first):
    ``accept_rate`` (``[G]``, mean ``Σ min(p_d, p_t)`` per slot), ``tau_probabilistic``,
    ``tau_greedy`` (``1 + Σ_k P(slots 0…k all hit)``: the teacher-forced τ of greedy decoding) and
    ``greedy_conditional_accept`` (``[G]``: slot k hits given slots before it did, the metric
    ``bench_speculative.py`` reports per position)."""
    blocks = parts["blocks"]
    return {
        "accept_rate": _safe_div(parts["accept_num"], parts["slot_count"]),
        "tau_probabilistic": _safe_div(parts["tau_num"], blocks),
        "tau_greedy": _safe_div(blocks + jnp.sum(parts["greedy_prefix_num"]), blocks),
        "greedy_conditional_accept": _safe_div(parts["greedy_prefix_num"], parts["greedy_reach_num"]),
    }


def _safe_div(num: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
    """``num / den``, and 0 (with a zero, finite gradient) where ``den == 0``."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def combine(parts: dict[str, jnp.ndarray], cfg: Any) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """``loss = α_ce·CE + α_tv·TV + α_conf·BCE`` with every term ``Σw·ℓ / Σw`` (§4.5).

    ``parts`` is :func:`block_losses`' dict, possibly summed over chunks / devices first.
    Returns ``(loss, metrics)``; metrics hold the per-term means, :func:`acceptance_metrics`
    and the counts. Every division is guarded (0, not NaN).
    """
    terms = {t: _safe_div(parts[f"{t}_num"], parts[f"{t}_den"]) for t in TERMS}
    loss = (
        cfg.ce_weight * terms["ce"]
        + cfg.tv_weight * terms["tv"]
        + cfg.confidence_weight * terms["conf"]
    )
    sup = parts["supervised"]
    metrics = {
        "loss": loss,
        "ce": terms["ce"],
        "tv": terms["tv"],
        "conf": terms["conf"],
        **acceptance_metrics(parts),
        "confidence_abs_error": _safe_div(parts["conf_abs_err_num"], parts["conf_den"]),
        "confidence_bias": _safe_div(parts["conf_bias_num"], parts["conf_den"]),
        "confidence_cumprod_bias": _safe_div(parts["conf_cumprod_bias_num"], parts["conf_den"]),
        "supervised": sup,
        "blocks": parts["blocks"],
        "ce_excluded": parts["ce_excluded"],
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Chunking over anchors
# --------------------------------------------------------------------------------------------


def chunked_block_losses(
    compute_chunk: Callable[[jnp.ndarray], tuple],
    num_anchors: int,
    chunk_size: int,
    cfg: Any,
    d2t_N: jnp.ndarray | None = None,
) -> dict[str, jnp.ndarray]:
    """:func:`block_losses` summed over anchor chunks, holding one chunk's logits at a time.

    ``compute_chunk(start)`` (``start`` a traced int32 scalar) must return
    ``(draft_logits, target_logits, labels, mask, confidence_logits_or_None, target_lse_or_None)``
    for anchors
    ``[start, start + chunk_size)`` — typically by ``lax.dynamic_slice_in_dim`` of the block
    hidden states and applying the LM heads. It must be a pure JAX function of ``start`` and of
    the arrays it closes over (with Flax NNX, ``nnx.split`` outside and ``nnx.merge`` inside).

    The chunks run in a ``lax.scan`` whose body is ``jax.checkpoint``-ed: the forward keeps only
    the running sums, and the backward recomputes each chunk's logits, so neither pass holds
    more than one chunk of ``[chunk, γ, V]`` logits. ``num_anchors`` must be a multiple of
    ``chunk_size`` (pad with ``keep=False`` anchors; a partial last chunk would make
    ``dynamic_slice`` clamp its start and count anchors twice).
    """
    if chunk_size < 1 or num_anchors < 1:
        raise ValueError(f"num_anchors and chunk_size must be >= 1, got {num_anchors}, {chunk_size}")
    if num_anchors % chunk_size:
        raise ValueError(
            f"num_anchors ({num_anchors}) must be a multiple of chunk_size ({chunk_size}); "
            "pad the anchors with keep=False blocks"
        )
    num_chunks = num_anchors // chunk_size

    @jax.checkpoint
    def one_chunk(start):
        draft, target, labels, mask, conf, lse = compute_chunk(start)
        return block_losses(draft, target, labels, mask, conf, cfg, d2t_N, lse)

    def body(acc, i):
        part = one_chunk(i * jnp.int32(chunk_size))
        return jax.tree.map(jnp.add, acc, part), None

    shapes = jax.eval_shape(one_chunk, jnp.int32(0))
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = jax.lax.scan(body, init, jnp.arange(num_chunks, dtype=jnp.int32))
    return total


# --------------------------------------------------------------------------------------------
# The drafter objective
# --------------------------------------------------------------------------------------------


class TrainBatch(NamedTuple):
    """One batch of target-cache sequences with sampled anchors (spec §5.3–§5.4)."""

    input_ids_BxS: jnp.ndarray  # int32 prompt + response tokens
    loss_mask_BxS: jnp.ndarray  # 1 where a token may be a label (response tokens)
    features_BxSxF: jnp.ndarray  # tapped target layer outputs, concatenated
    target_hidden_BxSxD: jnp.ndarray  # the target's post-final-norm hidden state (LM-head input)
    anchors_BxA: jnp.ndarray  # int32 anchor positions
    keep_BxA: jnp.ndarray  # bool: False for padding anchors
    # The target's full-vocabulary logsumexp per position (target cache ``lse``), or None. With
    # it, target logits are computed over the draft vocabulary only (see ``block_losses``).
    target_lse_BxS: jnp.ndarray | None = None
    # int32 real tokens per row (the rest is padding): what the target reads to compute the
    # three per-token arrays above when the cache holds token ids alone (train.batch_completer).
    lengths_B: jnp.ndarray | None = None


def _teacher_forced_blocks(drafter, embed_VxD, batch: TrainBatch):
    """A block drafter's backbone output at the batch's anchors and what its slots are scored
    on: ``(h [B, A, G, d], labels [B, A, G], mask [B, A, G], Markov inputs [B, A, G])`` — slot
    s's Markov input is the anchor token (s = 0) or the label before it (teacher forcing)."""
    anchor_tokens = jnp.take_along_axis(batch.input_ids_BxS, batch.anchors_BxA, axis=1)
    h = drafter.backbone.forward_train(
        embed_VxD, batch.features_BxSxF, batch.anchors_BxA, anchor_tokens, batch.keep_BxA
    )
    gamma = drafter.cfg.block_size
    labels = block_labels(batch.input_ids_BxS, batch.anchors_BxA, gamma)
    mask = block_label_mask(batch.loss_mask_BxS, batch.anchors_BxA, batch.keep_BxA, gamma)
    prev = jnp.concatenate([anchor_tokens[..., None], labels[..., :-1]], axis=-1)
    return h, labels, mask, prev


def drafter_loss(drafter, embed_VxD, lm_head_VxD, batch: TrainBatch, *, chunk_size: int):
    """``(loss, metrics)`` of a DSpark/DFlash drafter on one batch (spec §4).

    All blocks go through the backbone in one pass; the ``[A, γ, V]`` logits (draft and target,
    the latter recomputed from the stored final hidden state with the frozen head, §4.6) are
    produced and reduced ``chunk_size`` anchors at a time. Embedding and LM head are frozen.
    """
    cfg = drafter.cfg
    gamma = cfg.block_size
    h, labels, mask, prev = _teacher_forced_blocks(drafter, embed_VxD, batch)
    # The target distribution for label index a+s+1 comes from its hidden state at a+s.
    source = batch.anchors_BxA[..., None] + jnp.arange(gamma)
    target_hidden = _gather_along_seq(batch.target_hidden_BxSxD, source)
    frozen_head = jax.lax.stop_gradient(lm_head_VxD)
    target_lse, target_head = None, frozen_head
    if batch.target_lse_BxS is not None:
        target_lse = _gather_along_seq(batch.target_lse_BxS, source)
        if drafter.d2t_N is not None:
            target_head = frozen_head[drafter.d2t_N]

    def compute_chunk(start):
        def rows(x):
            return jax.lax.dynamic_slice_in_dim(x, start, chunk_size, axis=1)

        draft_logits, confidence = drafter.teacher_forced(rows(h), frozen_head, rows(prev))
        target_logits = project(rows(target_hidden), target_head).astype(jnp.float32)
        lse = None if target_lse is None else rows(target_lse)
        return draft_logits, target_logits, rows(labels), rows(mask), confidence, lse

    parts = chunked_block_losses(
        compute_chunk, batch.anchors_BxA.shape[1], chunk_size, cfg, drafter.d2t_N
    )
    return combine(parts, cfg)



def _ttt_step(drafter, lm_head_VxD, hidden_BxSxD, batch: TrainBatch, k: int):
    """EAGLE-3 TTT step k at the batch's anchors: ``(draft log-probs [B, A, N], label ids
    [B, A], supervised [B, A])``. Anchor a reads index ``a − 1`` and predicts token ``a + 1 + k``."""
    seq = batch.input_ids_BxS.shape[1]
    label = batch.anchors_BxA + 1 + k
    label_at = jnp.clip(label, 0, seq - 1)
    # Anchor 0 has no TTT index before it (a prompt precedes every response in practice).
    valid = batch.keep_BxA & (batch.anchors_BxA >= 1) & (label < seq) & (
        jnp.take_along_axis(batch.loss_mask_BxS, label_at, axis=1) > 0
    )
    index_BxA = jnp.clip(batch.anchors_BxA - 1, 0, seq - 1)
    h_BxAxD = _gather_along_seq(hidden_BxSxD, index_BxA[..., None])[:, :, 0]
    log_q = jax.nn.log_softmax(drafter.logits(h_BxAxD, lm_head_VxD), axis=-1)
    return log_q, jnp.take_along_axis(batch.input_ids_BxS, label_at, axis=1), valid


def eagle3_loss(drafter, embed_VxD, lm_head_VxD, batch: TrainBatch):
    """``(loss, metrics)`` of the EAGLE-3 baseline: training-time test over γ steps (spec §8.2).

    Step k at index t predicts token ``t + 2 + k`` and is scored by soft cross-entropy against the
    target's distribution there (``softmax(head(target_hidden[t + 1 + k]))``, restricted to the
    draft vocabulary when the drafter has a reduced head), supervised where that token is a
    response token inside the sequence; each step is weighted ``ttt_step_decay ** k``.

    The TTT layers run over every position (each step attends to all earlier ones), but the
    head and loss are evaluated at the batch's sampled anchors only: index ``t = a − 1`` for
    anchor ``a``, so step k predicts exactly what slot k of a DSpark block at ``a`` predicts.
    DeepSpec scores every position; sampling them gives the same objective in expectation and
    the same supervision per step as the block drafters, at a fraction of the head's cost (the
    ``[B, S, V]`` products dominated an EAGLE-3 step). The positions differ a little: DeepSpec
    supervises step k at t wherever ``t + k`` is a response token, so its chains may start in
    the prompt and the first response token's successor is never scored; here a chain starts
    where decoding starts one, at a response token followed by one. Each step's sum is
    normalised by the number of kept anchors, a fixed denominator across steps like the
    reference's ``B·S``; each step is rematerialised, so one step's ``[B, A, N]`` logits are
    alive at a time.
    """
    cfg = drafter.cfg
    seq = batch.input_ids_BxS.shape[1]
    hidden = drafter.forward_train(embed_VxD, batch.features_BxSxF, batch.input_ids_BxS)
    frozen_head = jax.lax.stop_gradient(lm_head_VxD)
    d2t = drafter.d2t_N
    in_vocab_head = frozen_head if d2t is None else frozen_head[d2t]
    kept = batch.keep_BxA.sum()

    def target_probs(source_BxA):
        """``p_t`` over the draft vocabulary (unnormalised there: mass outside it is unreachable)."""
        hidden_src = _gather_along_seq(batch.target_hidden_BxSxD, source_BxA[..., None])[:, :, 0]
        if batch.target_lse_BxS is not None:
            logits = project(hidden_src, in_vocab_head).astype(jnp.float32)
            lse = _gather_along_seq(batch.target_lse_BxS, source_BxA[..., None])[:, :, 0]
            return jnp.exp(logits - lse[..., None])
        p_full = jax.nn.softmax(project(hidden_src, frozen_head).astype(jnp.float32), axis=-1)
        return p_full if d2t is None else p_full[..., d2t]

    @jax.checkpoint
    def step_terms(hidden_BxSxD, k):
        log_q, labels, valid = _ttt_step(drafter, lm_head_VxD, hidden_BxSxD, batch, k)
        p_t = target_probs(jnp.clip(batch.anchors_BxA + k, 0, seq - 1))
        soft_ce = -(p_t * log_q).sum(-1)
        accept = jnp.minimum(p_t, jnp.exp(log_q)).sum(-1)
        hit = draft_argmax_ids(log_q, d2t) == labels
        return _safe_div(jnp.where(valid, soft_ce, 0.0).sum(), kept), accept, hit, valid

    loss = 0.0
    step_losses, accepts, hits, valids = [], [], [], []
    for k in range(hidden.shape[0]):
        step_loss, accept, hit, valid = step_terms(hidden[k], k)
        loss = loss + cfg.ttt_step_decay**k * step_loss
        step_losses.append(step_loss)
        accepts.append(accept)
        hits.append(hit)
        valids.append(valid)
    # Anchor a's TTT steps form a block like a DSpark block at a, scored by the same metrics.
    parts = acceptance_sums(jnp.stack(accepts, -1), jnp.stack(hits, -1), supervision_mask(jnp.stack(valids, -1)))
    metrics = {"loss": loss, "step_loss": jnp.stack(step_losses), **acceptance_metrics(parts)}
    return loss, metrics


def greedy_chains(drafter, embed_VxD, lm_head_VxD, batch: TrainBatch) -> jnp.ndarray:
    """``[B, A]`` int32: how many leading slots of the block at each anchor a greedy drafter
    gets right, teacher-forced (each slot drafted after the true tokens before it).

    On the target's greedy answer these are exactly the drafts greedy verification accepts in a
    round that starts at that anchor, so replaying rounds over them reproduces greedy decoding
    (``dspark_jax/eval/replay.py``). Works for block drafters and EAGLE-3 alike.
    """
    head = jax.lax.stop_gradient(lm_head_VxD)
    if drafter.cfg.kind == "eagle3":
        hidden = drafter.forward_train(embed_VxD, batch.features_BxSxF, batch.input_ids_BxS)
        hits, valids = [], []
        for k in range(hidden.shape[0]):
            log_q, labels, valid = _ttt_step(drafter, head, hidden[k], batch, k)
            hits.append(draft_argmax_ids(log_q, drafter.d2t_N) == labels)
            valids.append(valid)
        hit, mask = jnp.stack(hits, -1), supervision_mask(jnp.stack(valids, -1))
    else:
        h, labels, mask, prev = _teacher_forced_blocks(drafter, embed_VxD, batch)
        draft_logits, _ = drafter.teacher_forced(h, head, prev)
        hit = draft_argmax_ids(draft_logits, drafter.d2t_N) == labels
    return jnp.sum(jnp.cumprod((hit & mask).astype(jnp.int32), axis=-1), axis=-1)
