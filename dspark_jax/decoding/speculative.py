"""DSpark speculative decoding: draft -> choose verify lengths -> verify -> commit, batched.

One round per call pair, all shapes static:

1. ``draft`` (jitted once): the drafter (DSpark/DFlash or EAGLE-3, through
   ``dspark_jax.drafter.interface``) proposes γ tokens per slot from its context, with the draft
   distribution ``q`` and per-slot confidence (if it has a head); a policy turns that into a
   per-request verify length ``ℓ_r ∈ [0, γ]`` (data, not a shape).
2. ``verify`` (jitted once per width ``W`` in ``verify_widths``): the target scores
   ``[anchor, x_1..x_{W-1}]`` per row (only the first ``ℓ_r + 1`` count), ``verify.verify``
   accepts a prefix and adds one token, the target cache keeps ``anchor + accepted`` (by moving
   lengths) and the drafter's context grows by the same rows of tapped features, each with the
   committed token after it.

The host picks ``W`` as the smallest bucket ``>= max ℓ + 1`` so that verifying fewer tokens costs
less, and does per-request bookkeeping (stops, max_new_tokens). Finished rows are frozen. A policy
that plans ahead (the scheduler's ``plan_next_round``) tells after each drafted round what the
next does: verify at least some number of drafts a row (its ``floor``), or run *plain rounds*:
target steps that skip the draft (ℓ = 0 for every row). Both are decided before that round's
drafts exist. With more prompts than ``batch_size`` rows, a finished request's row is
prefilled with the next prompt between rounds (continuous batching, ``decoding.slots``).

``speculative_generate`` is the same rounds without the host: a whole generation as one
program for a caller's ``jax.jit`` (a ``lax.while_loop`` over rounds, the width picked on the
device).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax.config import SamplingConfig, as_int, as_ints
from dspark_jax.decoding.autoregressive import (
    AutoregressiveGenerator,
    FinishCallback,
    TokensCallback,
    bucket,
    cache_len,
    prepare_requests,
    prompt_width,
)
from dspark_jax.decoding.rows import RowSplit, in_mesh_scope
from dspark_jax.decoding.slots import Completions, Slots, StateRows, refill_sizes
from dspark_jax.decoding.target_protocol import SpeculativeTarget, feature_dtype
from dspark_jax.decoding.verify import verify
from dspark_jax.drafter.interface import SpeculativeDrafter
from dspark_jax.eval.metrics import (
    accepted_drafts,
    per_position_acceptance,
    tau_of,
    width_histogram,
)
from dspark_jax.sampling import SamplingParams, request_keys, sample, step_keys


@dataclasses.dataclass(frozen=True)
class FixedPolicy:
    """Verify ``k`` drafted tokens every round (0 = plain target decoding: after the first round,
    whose block the plain rounds reuse for its shapes, the drafter does not run)."""

    k: int

    @property
    def drafts(self) -> bool:
        return self.k > 0

    def __post_init__(self):
        object.__setattr__(self, "k", as_int(self.k, "fixed policy k"))  # numpy ints too
        if self.k < 0:
            raise ValueError(f"fixed policy needs k >= 0 drafted tokens, got {self.k}")

    def check_gamma(self, gamma: int) -> None:
        """Refuse verifying more drafts than the drafter proposes (as ``eval.compare.policy_for`` does)."""
        if self.k > gamma:
            raise ValueError(f"fixed:{self.k} asks for {self.k} drafts a round, but the drafter proposes "
                             f"γ = {gamma}: use fixed:K with K <= {gamma}")

    def lengths(self, confidence_BxG, gamma: int, active_B, sampling) -> jax.Array:
        return jnp.full(active_B.shape, min(self.k, gamma), jnp.int32)


@dataclasses.dataclass(frozen=True)
class ThresholdPolicy:
    """Verify up to the first slot whose confidence ``σ(z_k)`` falls below ``threshold``."""

    threshold: float

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float, np.integer, np.floating)):
            raise ValueError(f"confidence threshold must be a number in [0, 1], got {self.threshold!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {self.threshold}")

    def lengths(self, confidence_BxG, gamma: int, active_B, sampling) -> jax.Array:
        if confidence_BxG is None:
            raise ValueError("a threshold policy needs a drafter with a confidence head")
        keep = jax.nn.sigmoid(confidence_BxG) >= self.threshold
        return jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def parse_policy(text: str):
    """A policy from text: ``fixed:K``, ``threshold:X``, ``scheduler`` (to be profiled on this
    machine before decoding) or ``scheduler:PROFILE.json`` (a cost table from ``dspark profile``);
    ``scheduler-ahead`` / ``scheduler-ahead:PROFILE.json`` is the scheduler planning each round's
    width from the last (the paper's production variant, ``SchedulerPolicy.plan_ahead``)."""
    from dspark_jax.scheduler.prefix import SchedulerPolicy
    from dspark_jax.scheduler.profile import load_cost_tables

    def scheduler(value, plan_ahead):
        policy = SchedulerPolicy(plan_ahead=plan_ahead)
        if ":" in text and not value.strip():  # an unset $COSTS in "scheduler:$COSTS" must not profile quietly
            raise ValueError(f"policy {text!r} names no cost table after the colon: give its file, or "
                             f"{text.rstrip(': ')!r} to profile this machine at start")
        return policy.with_tables(load_cost_tables(value)) if value else policy

    def number(value, kind, convert, example, what="a number"):
        try:
            if not value.strip() or "_" in value:  # int() and float() read '1_0' as 10
                raise ValueError
            return convert(value)
        except ValueError:
            raise ValueError(f"policy {kind} needs {what} after the colon, e.g. {kind}:{example}; "
                             f"got {text!r}") from None

    kind, _, value = text.partition(":")
    parsers = {
        "fixed": lambda v: FixedPolicy(number(v, "fixed", int, 3, "a whole number")),
        "threshold": lambda v: ThresholdPolicy(number(v, "threshold", float, 0.5)),
        "scheduler": lambda v: scheduler(v, plan_ahead=False),
        "scheduler-ahead": lambda v: scheduler(v, plan_ahead=True),
    }
    if kind in parsers:
        return parsers[kind](value)  # a bad number, range or file raises its own clear error
    raise ValueError(f"policy must be 'fixed:K', 'threshold:X', 'scheduler', 'scheduler:PROFILE.json', "
                     f"'scheduler-ahead' or 'scheduler-ahead:PROFILE.json', got {text!r}")


# The most rounds in a row that skip the draft before drafting again to see whether it pays.
MAX_PLAIN_ROUNDS = 8

# A drafted round's floor before any plan: Algorithm 1 from zero drafts (a jit argument, as a
# planned floor is, so that the two share one program).
NO_FLOOR = np.int32(0)

# Stop ids travel as an array padded with -1 to a power of two >= 16, so their number is not a
# compiled shape up to 16; more compile one more verify program per power of two.
MIN_STOP_ID_SLOTS = 16


def stop_id_array(stop_ids: Sequence[int]) -> jax.Array:
    """Token ids (validated by ``prepare_requests``), deduplicated and padded with -1."""
    ids = sorted(set(stop_ids))
    return jnp.asarray(ids + [-1] * (bucket(len(ids), MIN_STOP_ID_SLOTS) - len(ids)), jnp.int32)


def checked_verify_widths(widths: Sequence[int] | None, gamma: int) -> tuple[int, ...]:
    """The verify forward widths a round picks from, sorted: ``widths`` (default: the powers of
    two below a full block, 1, 2, 4 for γ = 7), each in ``1..γ + 1``, with ``γ + 1`` added so
    that some width fits a full block ``[anchor, x_1..x_γ]``."""
    if widths is None:
        widths = [2**k for k in range(gamma.bit_length())]
    widths = as_ints(widths, "verify_widths")
    bad = sorted(w for w in set(widths) if not 1 <= w <= gamma + 1)
    if bad:
        raise ValueError(f"verify_widths {bad} are outside 1..{gamma + 1}: a verify forward scores the anchor "
                         f"and at most γ = {gamma} drafts")
    return tuple(sorted(set(widths) | {gamma + 1}))


def check_policy(policy, cfg, verify_widths: tuple[int, ...]) -> None:
    """Refuse, before anything compiles, a policy that is not one, that needs the confidence
    head ``cfg`` (a drafter's config) lacks, or whose own widths or γ do not match (a scheduler's
    cost table): each would otherwise fail inside the first jitted draft."""
    if not callable(getattr(policy, "lengths", None)):
        hint = f"parse_policy({policy!r})" if isinstance(policy, str) else "parse_policy('fixed:3')"
        raise TypeError(f"policy must be a policy object (FixedPolicy(3), ThresholdPolicy(0.5), SchedulerPolicy(), "
                        f"or any with a lengths() method; {hint} makes one from text), got {policy!r}")
    gamma = cfg.block_size
    if not cfg.confidence_head:
        jax.eval_shape(lambda: policy.lengths(None, gamma, jnp.ones((1,), bool), SamplingParams.broadcast(SamplingConfig(), 1)))
    for check, value in (("check_widths", verify_widths), ("check_gamma", gamma)):
        if hasattr(policy, check):
            getattr(policy, check)(value)


class DecodeState(NamedTuple):
    target_cache: Any  # the target's cache (dspark_jax.decoding.target_protocol.TargetCache)
    context: Any  # the drafter's own pytree (dspark_jax.drafter.interface)
    anchor_B: jax.Array  # int32: the last committed token (not yet in the target cache)
    round_B: jax.Array  # int32: rounds so far per request (for PRNG streams)


# ------------------------------------------------------------------------------------------
# One round as pure functions. ``target`` follows dspark_jax.decoding.target_protocol and is only
# used through ``apply``/``embedding_and_head`` with the ``params`` passed in; ``drafter`` is a
# live drafter module (inside a jitted function: ``nnx.merge(graph, drafter_state)`` of its
# state argument). So each step is a pure function of (target params, drafter state, decode
# state, inputs) that any ``jax.jit`` can trace; ``SpeculativeDecoder`` jits exactly these.


def prefill_step(target, drafter, params, cache, context, tokens_BxP, lens_B, keys_B, sampling):
    """Prompts (right-padded, ``lens_B`` real) through the target: the first token per row and
    the decode state (target cache, drafter context, anchor = that token)."""
    out = target.apply(
        params, tokens_BxP, cache, n_new_B=lens_B, logits_at_B=lens_B - 1, tap_layers=drafter.cfg.tap_layers
    )
    first = sample(out.logits, sampling, step_keys(keys_B, jnp.zeros_like(lens_B)))
    embed, _ = target.embedding_and_head(params)
    # The token after each prompt position: the prompt's next one, then the first sample.
    last_BxP = jnp.arange(tokens_BxP.shape[1]) == (lens_B - 1)[:, None]
    next_tokens = jnp.where(last_BxP, first[:, None], jnp.roll(tokens_BxP, -1, axis=1))
    context = drafter.extend_context(embed, context, out.taps, next_tokens, lens_B)
    state = DecodeState(out.cache, context, first, jnp.zeros_like(lens_B))
    return first, state


def propose_step(target, drafter, params, state, keys_B, sampling):
    """The drafter's block after each anchor and its confidence logits (``None`` for a drafter
    without a head): per row, unlike the policy, which may weigh the whole batch."""
    gamma = drafter.cfg.block_size
    embed, lm_head = target.embedding_and_head(params)
    round_keys = step_keys(keys_B, 2 * state.round_B + 1)
    slot_keys = jax.vmap(lambda k: jax.random.split(k, gamma))(round_keys)
    return drafter.propose(embed, lm_head, state.context, state.anchor_B, sampling, slot_keys)


def choose_lengths(policy, confidence, gamma: int, active_B, sampling, floor=0) -> jax.Array:
    """The policy's verify length per row, 0 for inactive rows. ``floor`` is what a policy that
    plans ahead (``plan_next_round``) set for this round after the last one."""
    planned = {"floor": floor} if hasattr(policy, "plan_next_round") else {}
    lengths = jnp.broadcast_to(policy.lengths(confidence, gamma, active_B, sampling, **planned), active_B.shape)
    return jnp.where(active_B, lengths, 0)


def draft_step(target, drafter, policy, params, state, keys_B, sampling, active_B, floor=0):
    """The drafter's block after each anchor, the policy's verify lengths (0 for inactive rows)
    and the confidence logits they came from (``None`` for a drafter without a head)."""
    block, confidence = propose_step(target, drafter, params, state, keys_B, sampling)
    return block, choose_lengths(policy, confidence, drafter.cfg.block_size, active_B, sampling, floor), confidence


def verify_step(target, drafter, params, state, block, lengths_B, keys_B, sampling, active_B, stop_ids, *, width):
    """The target scores ``[anchor, x_1..x_{width-1}]`` (``lengths_B <= width - 1`` count), the
    verdict, and the committed state: cache and context advanced by ``accepted + 1`` per active row."""
    tokens = jnp.concatenate([state.anchor_B[:, None], block.tokens_BxG], axis=1)[:, :width]
    out = target.apply(params, tokens, state.target_cache, tap_layers=drafter.cfg.tap_layers)
    verdict = verify(
        block.tokens_BxG, block.q_BxGxV, out.logits, lengths_B, sampling,
        step_keys(keys_B, 2 * state.round_B + 2), stop_ids,
    )
    committed = jnp.where(active_B, verdict.num_accepted_B + 1, 0)
    cache = out.cache.rollback(state.target_cache.lengths_B + committed)
    # Row j's next token is emitted[j]; -1 pads past the commit, where any id will do.
    next_tokens = jnp.maximum(verdict.emitted_BxE[:, : tokens.shape[1]], 0)
    embed, _ = target.embedding_and_head(params)
    context = drafter.extend_context(embed, state.context, out.taps, next_tokens, committed)
    anchor = jnp.take_along_axis(verdict.emitted_BxE, verdict.num_accepted_B[:, None], axis=1)[:, 0]
    anchor = jnp.where(active_B, anchor, state.anchor_B)
    new_state = DecodeState(cache, context, anchor, state.round_B + active_B.astype(jnp.int32))
    return verdict, new_state


def speculative_round(target, drafter, policy, params, state, keys_B, sampling, active_B, stop_ids, *, width):
    """Draft -> verify -> commit in one call at a fixed (static) ``width``; verify lengths are
    capped at ``width - 1``. Returns ``(verdict, lengths_B, new_state)``."""
    block, lengths, _ = draft_step(target, drafter, policy, params, state, keys_B, sampling, active_B)
    lengths = jnp.minimum(lengths, width - 1)
    verdict, new_state = verify_step(
        target, drafter, params, state, block, lengths, keys_B, sampling, active_B, stop_ids, width=width
    )
    return verdict, lengths, new_state


class DeviceGeneration(NamedTuple):
    tokens_BxN: jax.Array  # int32 [B, max_new_tokens]: each request's tokens, then -1
    num_tokens_B: jax.Array  # int32: tokens per request (its limit, or up to and including a stop id)
    stopped_B: jax.Array  # bool: the request ended on a stop id (else at its limit)
    rounds_B: jax.Array  # int32: speculative rounds the request took part in
    committed_B: jax.Array  # int32: tokens those rounds committed, before the cut at the limit
    rounds_per_width: jax.Array  # int32 [len(verify_widths)]: the batch's rounds verified at each width


def speculative_generate(target, drafter, policy, params, tokens_BxP, lens_B, keys_B, sampling, stop_ids, limits_B,
                         *, max_new_tokens: int, max_len: int, verify_widths: Sequence[int] | None = None,
                         ) -> DeviceGeneration:
    """Prefill, then speculative rounds in a ``lax.while_loop`` until every request has stopped
    or reached its limit: a whole generation in one program that any ``jax.jit`` can trace, with
    no host round trip per round. Each round verifies at the narrowest of ``verify_widths`` (as
    ``SpeculativeDecoder``'s, default and checks included) that holds its longest verify length,
    picked on the device (``lax.switch``), so the tokens are ``SpeculativeDecoder(target, drafter,
    policy=policy, verify_widths=...)``'s for the same inputs (``verify_widths=(γ + 1,)``:
    ``strict=True``'s). Plain rounds and planned floors are the host loop's: here every round
    drafts and the policy's lengths are its choice from zero drafts. ``limits_B`` cut each request
    as ``max_new_tokens`` does in ``generate``, clamped to ``1..max_new_tokens`` (data, which a
    traced program cannot refuse: the prefill's token always comes, and ``tokens_BxN`` holds no
    more than ``max_new_tokens``). The caches
    hold ``max_len`` positions: each request's prompt + limit + γ + 1 must fit
    (``prepare_requests(...).check_fits(max_len, γ + 1)`` checks a batch on the host; past the end
    a cache would drop writes), and so must the prefill's columns. One device:
    ``SpeculativeDecoder(mesh=...)`` splits a batch over several."""
    widths = checked_verify_widths(verify_widths, drafter.cfg.block_size)
    check_policy(policy, drafter.cfg, widths)
    batch, prompt_len = tokens_BxP.shape
    if prompt_len > max_len:
        raise ValueError(f"a prefill of {prompt_len} columns does not fit the cache length {max_len}")
    if 1 + max_new_tokens + widths[-1] > max_len:
        raise ValueError(f"a one-token prompt + max_new_tokens {max_new_tokens} + verify width {widths[-1]} does not "
                         f"fit the cache length {max_len}")
    limits_B = jnp.clip(limits_B, 1, max_new_tokens)
    cache = target.new_cache(batch, max_len)
    context = drafter.new_context(batch, max_len, feature_dtype(target))
    first, state = prefill_step(target, drafter, params, cache, context, tokens_BxP, lens_B, keys_B, sampling)
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    stopped = jnp.isin(first, stop_ids)  # as verify marks a stop id
    zeros = jnp.zeros((batch,), jnp.int32)
    start = DeviceGeneration(out, jnp.ones((batch,), jnp.int32), stopped, zeros, zeros,
                             jnp.zeros((len(widths),), jnp.int32))
    verify_at = [functools.partial(verify_step, target, drafter, width=w) for w in widths]

    def unfinished(carry):
        generation, _ = carry
        return (~generation.stopped_B & (generation.num_tokens_B < limits_B)).any()

    def one_round(carry):
        generation, state = carry
        active = ~generation.stopped_B & (generation.num_tokens_B < limits_B)
        block, lengths, _ = draft_step(target, drafter, policy, params, state, keys_B, sampling, active)
        narrowest = jnp.searchsorted(jnp.asarray(widths), lengths.max() + 1)  # inactive rows' lengths are 0
        verdict, state = jax.lax.switch(
            narrowest, verify_at, params, state, block, lengths, keys_B, sampling, active, stop_ids)
        emitted = jnp.where(active, verdict.num_emitted_B, 0)
        # A request keeps what fits its limit; a stop id counts only if it fits (as in Completions).
        kept = jnp.minimum(emitted, limits_B - generation.num_tokens_B)
        offsets = jnp.arange(verdict.emitted_BxE.shape[1])
        slots = jnp.where(offsets < kept[:, None], generation.num_tokens_B[:, None] + offsets, max_new_tokens)
        tokens = jax.vmap(lambda row, at, new: row.at[at].set(new, mode="drop"))(
            generation.tokens_BxN, slots, verdict.emitted_BxE)
        return DeviceGeneration(
            tokens, generation.num_tokens_B + kept,
            generation.stopped_B | (active & verdict.stopped_B & (emitted <= kept)),
            state.round_B, generation.committed_B + emitted, generation.rounds_per_width.at[narrowest].add(1),
        ), state

    generation, _ = jax.lax.while_loop(unfinished, one_round, (start, state))
    return generation


@dataclasses.dataclass
class SpeculativeResult:
    tokens: list[list[int]]
    finish_reasons: list[str]
    prefill_s: float
    decode_s: float
    rounds: int
    # per round: drafts the target accepted per active request, counting past a stop token among
    # them (the confidence head's labels; the metrics cut at the stop: ``accepted_drafts``)
    accepted_per_round: list[np.ndarray]
    # per round: tokens committed per active request, the round's accept length as the reference
    # counts it (spec §6.4): the accepted drafts and the target's token, or the drafts up to and
    # including a stop token among them (no target token then). Cuts at max_new_tokens not applied.
    committed_per_round: list[np.ndarray]
    verify_lengths: list[np.ndarray]  # per round: ℓ per active request
    verify_widths: list[int]
    # Decode-loop wall time split, host-timed at the syncs the loop already makes: ``draft_s``
    # runs until the verify lengths reach the host (the draft call has finished), ``verify_s``
    # until the verdict does; the rest of ``decode_s`` is host bookkeeping.
    draft_s: float = 0.0
    verify_s: float = 0.0
    # per drafted round: the confidence logits [active requests, γ] (empty for a drafter without a head)
    confidence_per_round: list[np.ndarray] = dataclasses.field(default_factory=list)
    plain_rounds: int = 0  # rounds that skipped the draft (target steps; counted in ``rounds``)
    rows_per_round: list[int] = dataclasses.field(default_factory=list)  # the batch's rows each round

    def per_position_acceptance(self, gamma: int) -> np.ndarray:
        if not self.accepted_per_round:
            return np.full(gamma, np.nan)
        accepted = accepted_drafts(np.concatenate(self.accepted_per_round), np.concatenate(self.committed_per_round))
        return per_position_acceptance(accepted, np.concatenate(self.verify_lengths), gamma)

    @property
    def width_histogram(self) -> dict[int, int]:
        return width_histogram(self.verify_widths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per request-round (``committed_per_round``)."""
        return tau_of(self.committed_per_round)


class SpeculativeDecoder:
    """Jitted prefill / draft / verify steps (the module-level pure functions) and a host loop.

    ``target`` is anything implementing ``dspark_jax.decoding.target_protocol.SpeculativeTarget``.
    ``policy`` is a policy object (``parse_policy`` makes one from text); the default verifies
    the drafter's whole block every round (``FixedPolicy(γ)``). ``verify_widths`` are the verify forward widths a round picks from,
    each in ``1..γ + 1`` (default: the powers of two below ``γ + 1``); ``γ + 1`` is always added.
    ``strict=True`` verifies every round at that one width ``γ + 1``; greedy output is then
    token-identical to ``self.reference_generator()`` (target-only decoding whose steps are
    forwards of that same width), whatever the drafter. The default picks the cheapest width per
    round, and can differ from plain target-only greedy decoding on exact near-ties
    (``docs/EXACTNESS.md``).

    ``mesh`` (a ``jax.sharding.Mesh`` with a ``data`` axis) splits every batch across its devices
    by rows, target and drafter weights replicated: each device drafts and verifies its own rows
    (``decoding.rows``), the batch size a multiple of the axis size. The verify width and the
    policy's lengths stay batch-wide (one program per round; the scheduler weighs every row
    against the cost of a round of the whole batch, so profile it on the same mesh). A request's
    tokens do not depend on the split.
    """

    def __init__(
        self,
        target: SpeculativeTarget,
        drafter: SpeculativeDrafter,
        *,
        policy=None,
        verify_widths: Sequence[int] | None = None,
        strict: bool = False,
        mesh: Mesh | None = None,
    ):
        drafter.cfg.check_target(target.cfg)
        self.target, self.cfg, self.strict = target, drafter.cfg, strict
        self.rows = RowSplit(mesh)
        gamma = self.cfg.block_size
        widths = checked_verify_widths(verify_widths, gamma)
        # Strict mode verifies every round at a full block's width alone, the one the reference
        # generator steps with.
        self.verify_widths = (gamma + 1,) if strict else widths
        self._feature_dtype = feature_dtype(target)
        self.drafter_graph, drafter_state = nnx.split(drafter)
        self.params, self.drafter_state = self.rows.replicate((target.params, drafter_state))
        self._new_cache = self.rows.allocate(target.new_cache, num_static=2)
        self._new_context = self.rows.allocate(drafter.new_context, num_static=3)
        graph = self.drafter_graph

        def prefill(params, drafter_state, cache, context, tokens_BxP, lens_B, keys_B, sampling):
            return prefill_step(
                target, nnx.merge(graph, drafter_state), params, cache, context, tokens_BxP, lens_B, keys_B, sampling
            )

        def verify_commit(params, drafter_state, state, block, lengths_B, keys_B, sampling, active_B, stop_ids, *, width):
            return verify_step(
                target, nnx.merge(graph, drafter_state), params, state, block, lengths_B, keys_B, sampling,
                active_B, stop_ids, width=width,
            )

        def verify_at(params, drafter_state, state, block, lengths_B, keys_B, sampling, active_B, stop_ids, *, width):
            step = self.rows.per_row(functools.partial(verify_commit, width=width), replicated=(0, 1, 8))
            return step(params, drafter_state, state, block, lengths_B, keys_B, sampling, active_B, stop_ids)

        self._prefill = jax.jit(self.rows.per_row(prefill, replicated=(0, 1)), donate_argnums=(2, 3))
        self._verify = jax.jit(verify_at, static_argnames=("width",), donate_argnames=("state",))
        feature = self._feature_dtype
        self._state_rows = StateRows(lambda batch: (
            DecodeState(target.new_cache(batch, 1), drafter.new_context(batch, 1, feature),
                        jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32)),
            request_keys(range(batch)), SamplingParams.broadcast(SamplingConfig(), batch),
        ))
        self._insert, self._take = self._state_rows.insert, self._state_rows.take
        self._set_policy(FixedPolicy(gamma) if policy is None else policy)

    def _set_policy(self, policy) -> None:
        """Bake ``policy`` into a freshly jitted draft step (the only step that reads it)."""
        check_policy(policy, self.cfg, self.verify_widths)
        gamma = self.cfg.block_size
        target, graph = self.target, self.drafter_graph

        def propose(params, drafter_state, state, keys_B, sampling):
            return propose_step(target, nnx.merge(graph, drafter_state), params, state, keys_B, sampling)

        propose = self.rows.per_row(propose, replicated=(0, 1))

        def draft(params, drafter_state, state, keys_B, sampling, active_B, floor):
            block, confidence = propose(params, drafter_state, state, keys_B, sampling)
            return block, choose_lengths(policy, confidence, gamma, active_B, sampling, floor), confidence

        self.policy = policy
        self._draft = jax.jit(draft)
        # A policy that plans ahead sets each round's floor, or skips its draft (plain rounds).
        plan = getattr(policy, "plan_next_round", None)
        self._plan_next_round = None if plan is None else jax.jit(plan)

    def with_policy(self, policy) -> SpeculativeDecoder:
        """This decoder with another policy. Prefill and verify do not read the policy, so their
        compiled programs are shared; only the draft step compiles again."""
        other = copy.copy(self)
        other._set_policy(policy)
        return other

    @in_mesh_scope
    def warmup(self, batch: int, prompt_len: int, max_len: int, *, refills: bool = False,
               buckets: bool = False) -> float:
        """Compile prefill, draft and every verify width for these shapes; returns seconds.
        ``refills``: also the prefills and row inserts of continuous batching into ``batch`` rows
        (every refill size), so that serving requests as they come compiles nothing. ``buckets``:
        all of it at every batch size ``generate(batch_buckets=True)`` runs, and the resizes."""
        start = time.perf_counter()
        sizes = refill_sizes(batch, self.rows.devices)
        for live in sizes if buckets else [batch]:
            state = self._dummy_prefill(live, prompt_len, max_len)
            if refills:
                state = self._state_rows.warm(state, live, lambda size: self._dummy_prefill(size, prompt_len, max_len),
                                              sizes, sizes if buckets else [batch])
            state, keys, params = state
            active, lengths = self.rows.on_rows((jnp.asarray(np.ones(live, bool)), jnp.zeros((live,), jnp.int32)))
            for width in self.verify_widths:
                block, _, confidence = self._draft(self.params, self.drafter_state, state, keys, params, active, NO_FLOOR)
                if self._plan_next_round is not None:
                    self._plan_next_round(confidence, active, params)
                _, state = self._verify(
                    self.params, self.drafter_state, state, block, lengths, keys, params, active,
                    stop_id_array(()), width=width,
                )
            jax.block_until_ready(state)
        return time.perf_counter() - start

    def _dummy_prefill(self, batch: int, prompt_len: int, max_len: int):
        """(DecodeState, keys, sampling) of ``batch`` one-token prompts padded as a ``prompt_len``
        prompt is; host arrays go through the same numpy -> device conversions as in generate()."""
        params, keys = self.rows.on_rows((SamplingParams.broadcast(SamplingConfig(), batch), request_keys(range(batch))))
        padded = np.zeros((batch, prompt_width(prompt_len, max_len)), np.int32)
        return self.prefill(batch, max_len, padded, [1] * batch, keys, params)[1], keys, params

    def reference_generator(self) -> AutoregressiveGenerator:
        """Target-only decoding that this decoder's greedy output equals token for token in
        strict mode (steps as wide as the verify forward, the same cache length: a ``max_len``
        passed by hand must be passed to both, since the cache length is part of the shape)."""
        return AutoregressiveGenerator(
            self.target, step_width=self.verify_widths[-1] if self.strict else 1, mesh=self.rows.mesh)

    @in_mesh_scope
    def prefill(self, batch: int, max_len: int, padded_BxP, lens, keys_B, sampling):
        """Prefill a fresh cache and drafter context: ``(first token per row, DecodeState)``.
        ``keys_B`` and ``sampling`` are already on rows (``self.rows.on_rows``)."""
        tokens, lens = self.rows.on_rows((jnp.asarray(padded_BxP, jnp.int32), jnp.asarray(lens, jnp.int32)))
        return self._prefill(
            self.params, self.drafter_state, self._new_cache(batch, max_len),
            self._new_context(batch, max_len, self._feature_dtype), tokens, lens, keys_B, sampling,
        )

    @property
    def slack(self) -> int:
        """Cache slots reserved past prompt + new tokens: room for the widest verify forward."""
        return self.verify_widths[-1]

    def cache_len_for(self, prompt_lens: Sequence[int], max_new_tokens: int) -> int:
        return cache_len(prompt_lens, max_new_tokens, self.target.cfg.max_position_embeddings, self.slack)

    def width_for(self, max_length: int) -> int:
        return next(w for w in self.verify_widths if w >= max_length + 1)

    @in_mesh_scope
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
        seeds: Sequence[int] | int = 0,
        stop_ids: Sequence[int] = (),
        max_len: int | None = None,
        batch_size: int | None = None,
        continuous: bool = True,
        on_finish: FinishCallback | None = None,
        on_tokens: TokensCallback | None = None,
        arrivals: Sequence[float] | None = None,
        batch_buckets: bool = False,
    ) -> SpeculativeResult:
        """Speculative generation; the same contract as ``AutoregressiveGenerator.generate``,
        continuous batching, ``arrivals`` and ``batch_buckets`` included. A refill prefills the
        joining requests between rounds; ``on_tokens`` gets each round's accepted drafts and
        target token at once. With ``batch_buckets`` a scheduler policy needs a cost table for
        every batch size the decoder may run (``scheduler.profile.profiled(batches=...)``), and the
        round after a resize drafts (the last round's block, which plain rounds reuse for their
        shapes, has the old rows)."""
        called = time.perf_counter()  # arrivals count from here, not after the checks below
        requests = prepare_requests(prompts, self.target.cfg.vocab_size, max_new_tokens, sampling, seeds, stop_ids)
        count = requests.batch
        if requests.max_new_tokens == 0:
            return SpeculativeResult([[] for _ in range(count)], ["length"] * count, 0.0, 0.0, 0, [], [], [], [])
        slots = Slots(count, count if batch_size is None else as_int(batch_size, "batch_size"), self.rows.devices,
                      continuous=continuous, arrivals=arrivals, buckets=batch_buckets, start=called)
        self.rows.check_batch(slots.rows)
        if hasattr(self.policy, "check_batches"):  # a missing cost table fails now, not mid-run
            self.policy.check_batches(slots.sizes if batch_buckets else [slots.rows])
        # Fitting the default cache refuses positions past the model's: a max_len given by hand
        # must not skip that.
        fitted = self.cache_len_for(requests.lens, requests.max_new_tokens)
        max_len = fitted if max_len is None else requests.check_fits(max_len, self.slack)
        stops = stop_id_array(requests.stop_ids)
        completions = Completions(slots, requests.limits, on_finish, on_tokens)

        accepted_log, committed_log, lengths_log, confidence_log, widths = [], [], [], [], []
        prefill_s = decode_s = draft_s = verify_s = 0.0
        # Plain rounds: after a drafted round whose plan is a plain round, the next ``skip``
        # rounds are target steps without a draft (ℓ = 0, decided before they exist); ``skip``
        # doubles while drafts keep not paying, up to MAX_PLAIN_ROUNDS. A policy that never
        # verifies a draft (fixed:0) runs plain rounds after the first. Otherwise the plan is the
        # next drafted round's ``floor``.
        skip = plain_left = plain_rounds = 0
        floor = NO_FLOOR
        block = None
        state = keys = params = None  # per row: DecodeState, PRNG keys, sampling parameters
        rows_per_round = []
        while True:
            while (fill := slots.refill()) is not None:
                rows, joining, size, whole, keep = fill
                start = time.perf_counter()
                if keep is not None:
                    state, keys, params = self._take((state, keys, params), keep)
                padded, fill_lens, fill_params, fill_keys = requests.pick(joining + joining[:1] * (size - len(joining)), max_len)
                fill_params, fill_keys = self.rows.on_rows((fill_params, fill_keys))
                first, filled = self.prefill(size, max_len, padded, fill_lens, fill_keys, fill_params)
                filled = (filled, fill_keys, fill_params)
                state, keys, params = filled if whole else self._insert(
                    (state, keys, params), filled, rows, size, slots.live)
                first = np.asarray(first)
                prefill_s += time.perf_counter() - start
                for row, token in zip(rows, first):
                    completions.emit(row, [token], int(token) in requests.stop_ids)
            active = slots.active
            if not active.any():
                if slots.wait_for_arrival():  # requests still to arrive: idle until the next
                    continue
                break
            t_draft = time.perf_counter()
            if (keep := slots.shrink()) is not None:
                state, keys, params = self._take((state, keys, params), keep)
                active = slots.active
            if block is not None and block.tokens_BxG.shape[0] != slots.live:
                block, plain_left = None, 0  # resized: plain rounds need a block of the new rows' shape
            active_j = self.rows.on_rows(jnp.asarray(active))
            drafting = plain_left == 0 and (block is None or getattr(self.policy, "drafts", True))
            if drafting:
                block, lengths, confidence = self._draft(
                    self.params, self.drafter_state, state, keys, params, active_j, floor)
                lengths_np = np.asarray(lengths)  # waits for the draft call
                width = self.width_for(int(lengths_np[active].max()))
            else:  # the last block rides along: at ℓ = 0 only the anchor's output counts
                plain_left, plain_rounds = max(plain_left - 1, 0), plain_rounds + 1
                lengths_np, width = np.zeros(slots.live, np.int32), self.verify_widths[0]
                # jnp.zeros as warmup compiles it (jnp.asarray of numpy compiles a copy per shape).
                lengths = self.rows.on_rows(jnp.zeros((slots.live,), jnp.int32))
            t_verify = time.perf_counter()
            draft_s += t_verify - t_draft
            verdict, state = self._verify(
                self.params, self.drafter_state, state, block, lengths, keys, params,
                active_j, stops, width=width,
            )
            if drafting and self._plan_next_round is not None:
                plan = int(self._plan_next_round(confidence, active_j, params))
                if plan >= 0:
                    skip, floor = 0, np.int32(plan)
                else:
                    skip, floor = min(max(2 * skip, 1), MAX_PLAIN_ROUNDS), NO_FLOOR
                    plain_left = skip
            if drafting and np.asarray(verdict.out_of_vocab_B)[active].any():
                raise ValueError(f"the drafter proposed a token id outside the target's vocabulary [0, "
                                 f"{self.target.cfg.vocab_size}): its propose() is broken (SpeculativeDrafter)")
            emitted = np.asarray(verdict.emitted_BxE)
            num = np.asarray(verdict.num_emitted_B)
            stopped = np.asarray(verdict.stopped_B)
            accepted_log.append(np.asarray(verdict.num_accepted_B)[active])
            committed_log.append(num[active])
            verify_s += time.perf_counter() - t_verify
            lengths_log.append(lengths_np[active])
            if drafting and confidence is not None:
                confidence_log.append(np.asarray(confidence)[active])
            widths.append(width)
            rows_per_round.append(slots.live)
            for row in np.flatnonzero(active):
                completions.emit(row, emitted[row, : num[row]], bool(stopped[row]))
            decode_s += time.perf_counter() - t_draft
        return SpeculativeResult(
            completions.tokens, completions.reasons, prefill_s, decode_s, len(widths), accepted_log, committed_log,
            lengths_log, widths, draft_s=draft_s, verify_s=verify_s, confidence_per_round=confidence_log,
            plain_rounds=plain_rounds, rows_per_round=rows_per_round,
        )
