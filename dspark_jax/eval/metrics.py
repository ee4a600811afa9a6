"""Analytic speculative-decoding metrics (spec §4.7, §6.6).

For one drafted token, speculative (rejection) sampling accepts with probability
``Σ_v min(p_d(v), p_t(v)) = 1 − TV(p_d, p_t)``, where ``TV = ½‖p_d − p_t‖₁`` is the total
variation distance. For a chain of γ drafts with conditional acceptance probabilities
``a_1 … a_γ`` (position k accepted given that 1 … k−1 were), the expected number of tokens a
round commits, counting the target's bonus token, is

    E[τ] = 1 + Σ_{k=1}^{γ} Π_{i≤k} a_i,        so 1 ≤ E[τ] ≤ γ + 1.

DeepSpec logs this with ``a = c*`` (the confidence soft label) as ``tau_probabilistic``.

Shapes: ``...`` are any leading (batch / block) axes; ``G`` is the slot axis (γ), always last.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def acceptance_probability(p_d: jnp.ndarray, p_t: jnp.ndarray, axis: int = -1) -> jnp.ndarray:
    """``Σ_v min(p_d, p_t)``: the probability that speculative sampling accepts one draft token."""
    return jnp.sum(jnp.minimum(p_d, p_t), axis=axis)


def total_variation(p_d: jnp.ndarray, p_t: jnp.ndarray, axis: int = -1) -> jnp.ndarray:
    """``TV(p_d, p_t) = ½‖p_d − p_t‖₁`` (the half-L1 distance, in [0, 1])."""
    return 0.5 * jnp.sum(jnp.abs(p_d - p_t), axis=axis)


def _masked_block_mean(values: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
    """Mean of per-block ``values`` over blocks where ``valid``; 0 (not NaN) when none are."""
    valid = jnp.broadcast_to(valid, values.shape).astype(values.dtype)
    count = jnp.sum(valid)
    total = jnp.sum(values * valid)
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)


def expected_tau(accept_probs: jnp.ndarray, valid: jnp.ndarray | None = None) -> jnp.ndarray:
    """Expected accepted length per round, bonus included: ``1 + Σ_k Π_{i≤k} a_i``.

    ``accept_probs`` is ``...xG``: conditional per-slot acceptance probabilities. To stop a
    block at its last supervised slot, multiply ``a`` by the slot mask first (a 0 ends the chain).

    With ``valid=None`` returns the per-block value (shape ``...``). With a block mask ``valid``
    (shape ``...`` or broadcastable to it) returns the scalar mean over valid blocks (0 if none).
    """
    a = jnp.asarray(accept_probs)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(jnp.float32)
    tau = 1.0 + jnp.sum(jnp.cumprod(a, axis=-1), axis=-1)
    if valid is None:
        return tau
    return _masked_block_mean(tau, valid)


def expected_tau_from_tv(tv: jnp.ndarray, valid: jnp.ndarray | None = None) -> jnp.ndarray:
    """:func:`expected_tau` with ``a_i = 1 − TV_i``; ``tv`` is the HALF-L1 total variation.

    (Pass ``0.5 × L1`` if you hold the training "TV" term, which is the full L1 by default.)
    ``a`` is clipped to [0, 1] so rounding cannot push τ outside [1, γ+1].
    """
    a = jnp.clip(1.0 - jnp.asarray(tv, dtype=jnp.result_type(tv, jnp.float32)), 0.0, 1.0)
    return expected_tau(a, valid)


def per_position_acceptance(accepted_R: np.ndarray, verify_len_R: np.ndarray, gamma: int) -> np.ndarray:
    """Observed conditional acceptance per draft position (the paper's Fig. 2 metric).

    Over request-rounds ``R`` with ``accepted`` drafts kept out of ``verify_len`` offered, position
    k (1-based) was *tried* when ``verify_len >= k`` and ``accepted >= k − 1``, and *accepted*
    when ``accepted >= k``. Returns ``[γ]`` accepted / tried (NaN where never tried).
    """
    accepted = np.asarray(accepted_R)[:, None]
    offered = np.asarray(verify_len_R)[:, None]
    k = np.arange(1, gamma + 1)[None, :]
    tried = ((offered >= k) & (accepted >= k - 1)).sum(0)
    kept = ((offered >= k) & (accepted >= k)).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tried > 0, kept / np.maximum(tried, 1), np.nan)


def accepted_drafts(accepted_R: np.ndarray, committed_R: np.ndarray) -> np.ndarray:
    """Accepted drafts per request-round as the reference records them (``accepted_draft_length``,
    spec §6.4 step 4 and §6.6): a stop token among the accepted drafts cuts the count there, since
    the round commits the drafts through it and no target token. So the drafts after it count as
    offered and not accepted, whatever the target made of them."""
    return np.minimum(np.asarray(accepted_R), np.asarray(committed_R))


def tau_of(committed_per_round) -> float:
    """τ: mean tokens committed per request-round, from arrays of each round's committed tokens
    (accepted drafts + the target's token, or through a stop token among the drafts: spec §6.4).
    NaN without rounds."""
    committed = np.concatenate([np.ravel(c) for c in committed_per_round]) if len(committed_per_round) else np.zeros(0)
    return float(np.mean(committed)) if committed.size else float("nan")


def mean_batch_rows(result) -> float | None:
    """How full a generation's batch ran: the mean rows of its steps (target-only) or rounds
    (speculative), which batch buckets make smaller than its batch size. None without steps."""
    rows = getattr(result, "rows_per_round", None) or getattr(result, "rows_per_step", None)
    return float(np.mean(rows)) if rows else None


def width_histogram(widths: list[int]) -> dict[int, int]:
    """How many rounds ran each verify width."""
    values, counts = np.unique(np.asarray(widths, int), return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}
