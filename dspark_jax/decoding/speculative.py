"""DSpark speculative decoding: draft -> choose verify lengths -> verify -> commit, batched.

One round per call pair, all shapes static:

1. ``draft`` (jitted once): the drafter proposes γ tokens per slot from its context cache, with
   the draft distribution ``q`` and per-slot confidence; a policy turns that into a per-request
   verify length ``ℓ_r ∈ [0, γ]`` (data, not a shape).
2. ``verify`` (jitted once per width ``W`` in ``verify_widths``): the target scores
   ``[anchor, x_1..x_{W-1}]`` per row (only the first ``ℓ_r + 1`` count), ``verify.verify``
   accepts a prefix and adds one token, the target cache keeps ``anchor + accepted`` (by moving
   lengths) and the drafter's context grows by the same rows of tapped features.

The host picks ``W`` as the smallest bucket ``>= max ℓ + 1`` so that verifying fewer tokens costs
less, and does per-request bookkeeping (stops, max_new_tokens). Finished rows are frozen.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import SamplingConfig
from dspark_jax.decoding.autoregressive import bucket, cache_len, prepare_requests
from dspark_jax.decoding.verify import verify
from dspark_jax.drafter.backbone import ContextCache
from dspark_jax.drafter.model import Drafter
from dspark_jax.eval.metrics import per_position_acceptance, width_histogram
from dspark_jax.models.kv_cache import KVCache
from dspark_jax.models.target import TargetModel
from dspark_jax.sampling import SamplingParams, request_keys, sample, step_keys


@dataclasses.dataclass(frozen=True)
class FixedPolicy:
    """Verify ``k`` drafted tokens every round (0 = plain target decoding)."""

    k: int

    def __post_init__(self):
        if self.k < 0:
            raise ValueError(f"fixed policy needs k >= 0 drafted tokens, got {self.k}")

    def lengths(self, confidence_BxG, gamma: int) -> jax.Array:
        batch = confidence_BxG.shape[0] if confidence_BxG is not None else 1
        return jnp.full((batch,), min(self.k, gamma), jnp.int32)


@dataclasses.dataclass(frozen=True)
class ThresholdPolicy:
    """Verify up to the first slot whose confidence ``σ(z_k)`` falls below ``threshold``."""

    threshold: float

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {self.threshold}")

    def lengths(self, confidence_BxG, gamma: int) -> jax.Array:
        if confidence_BxG is None:
            raise ValueError("a threshold policy needs a drafter with a confidence head")
        keep = jax.nn.sigmoid(confidence_BxG) >= self.threshold
        return jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def parse_policy(text: str):
    """A policy from text: ``fixed:K`` or ``threshold:X``."""
    kind, _, value = text.partition(":")
    parsers = {"fixed": lambda v: FixedPolicy(int(v)), "threshold": lambda v: ThresholdPolicy(float(v))}
    if kind in parsers:
        return parsers[kind](value)  # a bad number or range raises its own clear ValueError
    raise ValueError(f"policy must be 'fixed:K' or 'threshold:X', got {text!r}")


# Stop ids travel as a fixed-size array padded with -1, so their number is not a compiled shape.
MAX_STOP_IDS = 16


def stop_id_array(stop_ids: Sequence[int]) -> jax.Array:
    ids = sorted(set(int(s) for s in stop_ids))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids are supported, got {len(ids)}")
    return jnp.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), jnp.int32)


class DecodeState(NamedTuple):
    target_cache: KVCache
    context: ContextCache
    anchor_B: jax.Array  # int32: the last committed token (not yet in the target cache)
    round_B: jax.Array  # int32: rounds so far per request (for PRNG streams)


@dataclasses.dataclass
class SpeculativeResult:
    tokens: list[list[int]]
    finish_reasons: list[str]
    prefill_s: float
    decode_s: float
    rounds: int
    accepted_per_round: list[np.ndarray]  # per round: accepted drafts per active request
    verify_lengths: list[np.ndarray]  # per round: ℓ per active request
    verify_widths: list[int]

    def per_position_acceptance(self, gamma: int) -> np.ndarray:
        if not self.accepted_per_round:
            return np.full(gamma, np.nan)
        return per_position_acceptance(
            np.concatenate(self.accepted_per_round), np.concatenate(self.verify_lengths), gamma
        )

    @property
    def width_histogram(self) -> dict[int, int]:
        return width_histogram(self.verify_widths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per request-round (accepted drafts + the target's token)."""
        accepted = np.concatenate(self.accepted_per_round) if self.accepted_per_round else np.zeros(0)
        return float(np.mean(accepted + 1)) if accepted.size else float("nan")


class SpeculativeDecoder:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        *,
        policy=FixedPolicy(7),
        verify_widths: Sequence[int] = (1, 2, 4, 8),
    ):
        drafter.cfg.check_target(target.cfg)
        self.target, self.cfg, self.policy = target, drafter.cfg, policy
        gamma = self.cfg.block_size
        self.verify_widths = tuple(sorted(set(int(w) for w in verify_widths if w >= 1)))
        if not self.verify_widths or self.verify_widths[-1] < gamma + 1:
            # Some bucket must fit a full block: [anchor, x_1..x_γ].
            self.verify_widths = tuple(sorted(set(self.verify_widths) | {gamma + 1}))
        # The policy is baked into the jitted draft step: build a new decoder to change it.
        self.drafter_graph, self.drafter_state = nnx.split(drafter)
        taps = self.cfg.tap_layers

        def prefill(params, drafter_state, cache, context, tokens_BxP, lens_B, keys_B, sampling):
            out = target.apply(
                params, tokens_BxP, cache, n_new_B=lens_B, logits_at_B=lens_B - 1, tap_layers=taps
            )
            first = sample(out.logits, sampling, step_keys(keys_B, jnp.zeros_like(lens_B)))
            drafter_ = nnx.merge(self.drafter_graph, drafter_state)
            context = drafter_.backbone.extend_context(context, out.taps, lens_B)
            state = DecodeState(out.cache, context, first, jnp.zeros_like(lens_B))
            return first, state

        def draft(params, drafter_state, state, keys_B, sampling, active_B):
            drafter_ = nnx.merge(self.drafter_graph, drafter_state)
            embed, lm_head = target.embedding_and_head(params)
            round_keys = step_keys(keys_B, 2 * state.round_B + 1)
            slot_keys = jax.vmap(lambda k: jax.random.split(k, gamma))(round_keys)
            block, confidence = drafter_.propose(
                embed, lm_head, state.context, state.anchor_B, sampling, slot_keys
            )
            lengths = jnp.broadcast_to(policy.lengths(confidence, gamma), active_B.shape)
            return block, jnp.where(active_B, lengths, 0)

        def verify_commit(params, drafter_state, state, block, lengths_B, keys_B, sampling, active_B, stop_ids, *, width):
            drafter_ = nnx.merge(self.drafter_graph, drafter_state)
            tokens = jnp.concatenate([state.anchor_B[:, None], block.tokens_BxG], axis=1)[:, :width]
            out = target.apply(params, tokens, state.target_cache, tap_layers=taps)
            verdict = verify(
                block.tokens_BxG, block.q_BxGxV, out.logits, lengths_B, sampling,
                step_keys(keys_B, 2 * state.round_B + 2), stop_ids,
            )
            committed = jnp.where(active_B, verdict.num_accepted_B + 1, 0)
            cache = out.cache.rollback(state.target_cache.lengths_B + committed)
            context = drafter_.backbone.extend_context(state.context, out.taps, committed)
            anchor = jnp.take_along_axis(verdict.emitted_BxE, verdict.num_accepted_B[:, None], axis=1)[:, 0]
            anchor = jnp.where(active_B, anchor, state.anchor_B)
            new_state = DecodeState(cache, context, anchor, state.round_B + active_B.astype(jnp.int32))
            return verdict, new_state

        self._prefill = jax.jit(prefill, donate_argnums=(2, 3))
        self._draft = jax.jit(draft)
        self._verify = jax.jit(verify_commit, static_argnames=("width",), donate_argnames=("state",))

    def warmup(self, batch: int, prompt_len: int, max_len: int) -> float:
        """Compile prefill, draft and every verify width for these shapes; returns seconds."""
        start = time.perf_counter()
        params = SamplingParams.broadcast(SamplingConfig(), batch)
        keys = request_keys(range(batch))
        # Host arrays go through the same numpy -> device conversions as in generate().
        active = jnp.asarray(np.ones(batch, bool))
        _, state = self._prefill(
            self.target.params, self.drafter_state, self.target.new_cache(batch, max_len),
            ContextCache.create(self.cfg, batch, max_len, self.target.params[0].dtype),
            jnp.asarray(np.zeros((batch, bucket(prompt_len)), np.int32)),
            jnp.asarray([1] * batch, jnp.int32), keys, params,
        )
        for width in self.verify_widths:
            block, _ = self._draft(self.target.params, self.drafter_state, state, keys, params, active)
            lengths = jnp.zeros((batch,), jnp.int32)
            _, state = self._verify(
                self.target.params, self.drafter_state, state, block, lengths, keys, params, active,
                stop_id_array(()), width=width,
            )
        jax.block_until_ready(state)
        return time.perf_counter() - start

    def width_for(self, max_length: int) -> int:
        return next(w for w in self.verify_widths if w >= max_length + 1)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
        seeds: Sequence[int] | int = 0,
        stop_ids: Sequence[int] = (),
        max_len: int | None = None,
    ) -> SpeculativeResult:
        """Speculative generation; the same contract as ``AutoregressiveGenerator.generate``."""
        requests = prepare_requests(prompts, self.target.cfg.vocab_size, max_new_tokens, sampling, seeds)
        batch = requests.batch
        if max_new_tokens == 0:
            return SpeculativeResult([[] for _ in range(batch)], ["length"] * batch, 0.0, 0.0, 0, [], [], [])
        slack = self.verify_widths[-1]
        if max_len is None:
            max_len = cache_len(requests.lens, max_new_tokens, self.target.cfg.max_position_embeddings, slack)
        requests.check_fits(max_new_tokens, slack, max_len)
        params, keys = requests.params, requests.keys_B
        stops = stop_id_array(stop_ids)

        start = time.perf_counter()
        first, state = self._prefill(
            self.target.params, self.drafter_state, self.target.new_cache(batch, max_len),
            ContextCache.create(self.cfg, batch, max_len, self.target.params[0].dtype),
            jnp.asarray(requests.padded_BxP), jnp.asarray(requests.lens, jnp.int32), keys, params,
        )
        first = np.asarray(first)
        prefill_s = time.perf_counter() - start

        out = [[int(t)] for t in first]
        reasons = ["length"] * batch
        active = np.ones(batch, bool)
        for row in range(batch):
            if int(first[row]) in set(int(s) for s in stop_ids):
                active[row], reasons[row] = False, "stop"
            elif max_new_tokens <= 1:
                active[row] = False
        accepted_log, lengths_log, widths = [], [], []
        start = time.perf_counter()
        while active.any():
            active_j = jnp.asarray(active)
            block, lengths = self._draft(self.target.params, self.drafter_state, state, keys, params, active_j)
            lengths_np = np.asarray(lengths)
            width = self.width_for(int(lengths_np[active].max()))
            verdict, state = self._verify(
                self.target.params, self.drafter_state, state, block, lengths, keys, params,
                active_j, stops, width=width,
            )
            emitted = np.asarray(verdict.emitted_BxE)
            num = np.asarray(verdict.num_emitted_B)
            stopped = np.asarray(verdict.stopped_B)
            accepted_log.append(np.asarray(verdict.num_accepted_B)[active])
            lengths_log.append(lengths_np[active])
            widths.append(width)
            for row in np.flatnonzero(active):
                room = max_new_tokens - len(out[row])
                out[row].extend(int(t) for t in emitted[row, : min(num[row], room)])
                if stopped[row] and num[row] <= room:
                    active[row], reasons[row] = False, "stop"
                elif len(out[row]) >= max_new_tokens:
                    active[row] = False
        decode_s = time.perf_counter() - start
        return SpeculativeResult(out, reasons, prefill_s, decode_s, len(widths), accepted_log, lengths_log, widths)
