"""The decoders on a target that is not ours: a minimal ``flax.linen`` decoder written here.

It implements ``dspark_jax.decoding.target_protocol.SpeculativeTarget`` and nothing more (its own
config record, cache pytree, parameters as a linen variable dict), so these tests fail if a
decoder reaches past the protocol. They also run one speculative round inside a user's own
``jax.jit`` from the module-level pure steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, SamplingConfig, TargetConfig
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.decoding.speculative import (
    FixedPolicy,
    SpeculativeDecoder,
    prefill_step,
    speculative_generate,
    speculative_round,
    stop_id_array,
)
from dspark_jax.decoding.target_protocol import SpeculativeTarget, TargetCache, TargetOutput
from dspark_jax.drafter.model import Drafter
from dspark_jax.sampling import SamplingParams, request_keys
from tests.refills import counting_refills
from tests.tiny import tiny_target


@dataclasses.dataclass(frozen=True)
class LinenConfig:
    vocab_size: int = 24
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 128


class LinenCache(NamedTuple):
    keys: jax.Array  # [layers, B, S, heads, head_dim]
    values: jax.Array
    lengths_B: jax.Array

    def rollback(self, lengths_B):
        return self._replace(lengths_B=jnp.minimum(self.lengths_B, lengths_B.astype(jnp.int32)))


class Block(nn.Module):
    cfg: LinenConfig

    @nn.compact
    def __call__(self, x, keys, values, positions_BxT):
        cfg = self.cfg
        batch = x.shape[0]
        h = nn.RMSNorm()(x)
        q, k, v = (
            nn.DenseGeneral((cfg.num_heads, cfg.head_dim), use_bias=False, name=name)(h) for name in "qkv"
        )
        rows = jnp.arange(batch)[:, None]
        keys = keys.at[rows, positions_BxT].set(k, mode="drop")
        values = values.at[rows, positions_BxT].set(v, mode="drop")
        scores = jnp.einsum("bthd,bshd->bhts", q, keys) / math.sqrt(cfg.head_dim)
        visible = jnp.arange(keys.shape[1])[None, None, :] <= positions_BxT[:, :, None]
        scores = jnp.where(visible[:, None], scores, -1e30)
        attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), values)
        x = x + nn.DenseGeneral(cfg.hidden_size, axis=(-2, -1), use_bias=False, name="o")(attn)
        h = nn.RMSNorm()(x)
        return x + nn.Dense(cfg.hidden_size)(nn.gelu(nn.Dense(4 * cfg.hidden_size)(h))), keys, values


class TinyLM(nn.Module):
    cfg: LinenConfig

    def setup(self):
        self.embed = nn.Embed(self.cfg.vocab_size, self.cfg.hidden_size)
        self.position = nn.Embed(self.cfg.max_position_embeddings, self.cfg.hidden_size)
        self.blocks = [Block(self.cfg) for _ in range(self.cfg.num_layers)]
        self.norm = nn.RMSNorm()

    def __call__(self, tokens_BxT, keys, values, lengths_B, tap_layers=()):
        positions = lengths_B[:, None] + jnp.arange(tokens_BxT.shape[1])[None, :]
        # Padding may run past the table; its outputs are ignored and its cache writes dropped.
        x = self.embed(tokens_BxT) + self.position(jnp.minimum(positions, self.cfg.max_position_embeddings - 1))
        new_keys, new_values, taps = [], [], []
        for index, block in enumerate(self.blocks):
            x, k, v = block(x, keys[index], values[index], positions)
            new_keys.append(k)
            new_values.append(v)
            if index in tap_layers:
                taps.append(x)
        return self.embed.attend(self.norm(x)), taps, jnp.stack(new_keys), jnp.stack(new_values)


class LinenTarget:
    """The protocol around ``TinyLM``: ``cfg``, ``params``, ``apply``, ``new_cache``, ``embedding_and_head``."""

    def __init__(self, cfg: LinenConfig = LinenConfig(), seed: int = 0):
        self.cfg, self.module = cfg, TinyLM(cfg)
        empty = self.new_cache(1, 8)
        self.params = self.module.init(
            jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32), empty.keys, empty.values, empty.lengths_B
        )

    def apply(self, params, tokens_BxT, cache, *, n_new_B=None, logits_at_B=None, tap_layers=()):
        batch, steps = tokens_BxT.shape
        logits, taps, keys, values = self.module.apply(
            params, tokens_BxT, cache.keys, cache.values, cache.lengths_B, tuple(tap_layers)
        )
        if logits_at_B is not None:
            logits = logits[jnp.arange(batch), logits_at_B]
        tapped = jnp.concatenate(taps, axis=-1) if taps else jnp.zeros((batch, steps, 0), jnp.float32)
        n_new = jnp.full((batch,), steps, jnp.int32) if n_new_B is None else n_new_B.astype(jnp.int32)
        return TargetOutput(logits.astype(jnp.float32), tapped, LinenCache(keys, values, cache.lengths_B + n_new))

    def new_cache(self, batch, max_len):
        c = self.cfg
        shape = (c.num_layers, batch, max_len, c.num_heads, c.head_dim)
        return LinenCache(jnp.zeros(shape), jnp.zeros(shape), jnp.zeros((batch,), jnp.int32))

    def embedding_and_head(self, params):
        table = params["params"]["embed"]["embedding"]
        return table, table  # tied


GAMMA = 3
PROMPTS = [[1, 5, 7, 2, 9, 11, 3], [4, 4, 8], [2, 19, 6, 6, 1, 13, 17, 20, 22, 5, 3, 12]]


@pytest.fixture(scope="module")
def linen():
    target = LinenTarget()
    c = target.cfg
    # A DSpark drafter for it: the same hidden size, vocabulary and attention shape.
    shape = TargetConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=64, num_layers=c.num_layers,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=10000.0,
        tie_word_embeddings=True, qk_norm=False, max_position_embeddings=c.max_position_embeddings,
    )
    cfg = DrafterConfig.for_target(shape, num_layers=1, tap_layers=(0,), mask_token_id=0, block_size=GAMMA)
    drafter = Drafter(cfg, rngs=nnx.Rngs(7))  # random
    reference = AutoregressiveGenerator(target).generate(PROMPTS, max_new_tokens=20)
    return target, drafter, reference


def test_both_targets_satisfy_the_protocol(linen):
    target, _, _ = linen
    assert isinstance(target, SpeculativeTarget)
    assert isinstance(tiny_target(), SpeculativeTarget)
    assert isinstance(target.new_cache(2, 16), TargetCache)
    assert isinstance(tiny_target().new_cache(2, 16), TargetCache)


@pytest.mark.parametrize("taps", [(1, 2, 3), (2, 1), (1, 1), (-1,)])
def test_our_target_refuses_tap_layers_it_cannot_return(taps):
    """Three layers: a tap past them, a repeat or a descending order would return taps of
    another width or order than ``len(tap_layers) * d`` in ascending layer order."""
    target = tiny_target()
    with pytest.raises(ValueError, match="tap layer ids"):
        target.apply(target.params, jnp.ones((1, 2), jnp.int32), target.new_cache(1, 8), tap_layers=taps)


@pytest.mark.parametrize("k", [0, 2, GAMMA])
def test_speculative_greedy_equals_target_only_on_a_linen_target(linen, k):
    target, drafter, reference = linen
    decoder = SpeculativeDecoder(target, drafter, policy=FixedPolicy(k))
    result = decoder.generate(PROMPTS, max_new_tokens=20)
    assert result.tokens == reference.tokens
    assert all((lengths == k).all() for lengths in result.verify_lengths)


def test_continuous_batching_on_a_linen_target_whose_cache_keeps_layers_first(linen):
    """Refilled rows are found by shape (this cache is ``[layers, B, ...]``): one row at a time,
    the other rows decoding on, every request gets its one-batch tokens."""
    target, drafter, _ = linen
    prompts = PROMPTS * 2
    stop = [22]  # the first prompt's first greedy token: it stops at once while the others run on
    for runner in (AutoregressiveGenerator(target), SpeculativeDecoder(target, drafter, policy=FixedPolicy(2))):
        one_batch = runner.generate(prompts, max_new_tokens=20, stop_ids=stop)
        assert set(one_batch.finish_reasons) == {"stop", "length"}
        refills = counting_refills(runner)
        assert runner.generate(prompts, max_new_tokens=20, stop_ids=stop, batch_size=2).tokens == one_batch.tokens
        assert refills, type(runner).__name__


def test_strict_speculative_greedy_equals_its_reference_on_a_linen_target(linen):
    """Strict mode: one verify width (γ + 1), and target-only steps of that same width."""
    target, drafter, reference = linen
    strict = SpeculativeDecoder(target, drafter, policy=FixedPolicy(2), strict=True)
    assert strict.verify_widths == (GAMMA + 1,)
    generator = strict.reference_generator()
    assert generator.step_width == GAMMA + 1
    strict_reference = generator.generate(PROMPTS, max_new_tokens=20)
    assert strict.generate(PROMPTS, max_new_tokens=20).tokens == strict_reference.tokens
    # On this model the strict reference is also plain greedy decoding (no near-ties).
    assert strict_reference.tokens == reference.tokens


def test_a_round_runs_inside_a_users_own_jit(linen):
    """Prefill and draft -> verify -> commit as pure functions of (target params, drafter state,
    decode state, inputs), jitted by the caller; the weights are arguments, not constants."""
    target, drafter, reference = linen
    graph, drafter_state = nnx.split(drafter)
    policy, width, batch = FixedPolicy(GAMMA), GAMMA + 1, len(PROMPTS)
    traces = []

    @jax.jit
    def user_prefill(params, drafter_state, tokens, lens, keys, sampling):
        cache, context = target.new_cache(batch, 64), nnx.merge(graph, drafter_state).new_context(batch, 64, jnp.float32)
        return prefill_step(target, nnx.merge(graph, drafter_state), params, cache, context, tokens, lens, keys, sampling)

    @jax.jit
    def user_round(params, drafter_state, state, keys, sampling, active, stop_ids):
        traces.append(1)
        return speculative_round(
            target, nnx.merge(graph, drafter_state), policy, params, state, keys, sampling, active, stop_ids, width=width
        )

    padded = np.zeros((batch, 16), np.int32)
    for row, prompt in enumerate(PROMPTS):
        padded[row, : len(prompt)] = prompt
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    sampling, keys = SamplingParams.broadcast(SamplingConfig(), batch), request_keys(range(batch))
    active, stops = jnp.ones((batch,), bool), stop_id_array(())
    first, state = user_prefill(target.params, drafter_state, jnp.asarray(padded), lens, keys, sampling)
    out = [[int(t)] for t in np.asarray(first)]
    start_state = state
    while min(len(t) for t in out) < 20:
        verdict, lengths, state = user_round(target.params, drafter_state, state, keys, sampling, active, stops)
        assert (np.asarray(lengths) == GAMMA).all()
        emitted, num = np.asarray(verdict.emitted_BxE), np.asarray(verdict.num_emitted_B)
        for row in range(batch):
            out[row].extend(int(t) for t in emitted[row, : num[row]])
    assert [t[:20] for t in out] == reference.tokens
    assert len(traces) == 1

    # Other target weights change the result without retracing: they are inputs of the round.
    scaled = jax.tree.map(lambda x: -x, target.params)
    verdict_scaled, _, _ = user_round(scaled, drafter_state, start_state, keys, sampling, active, stops)
    verdict_real, _, _ = user_round(target.params, drafter_state, start_state, keys, sampling, active, stops)
    assert not np.array_equal(np.asarray(verdict_scaled.emitted_BxE), np.asarray(verdict_real.emitted_BxE))
    assert np.array_equal(np.asarray(verdict_real.emitted_BxE)[:, :1], np.asarray([[t[1]] for t in out]))
    assert len(traces) == 1


def test_a_whole_generation_runs_inside_a_users_own_jit(linen):
    """``speculative_generate`` on a target whose cache keeps layers first: the prefill and every
    round in one jitted program give the target's greedy tokens."""
    target, drafter, reference = linen
    graph, drafter_state = nnx.split(drafter)
    batch, limit = len(PROMPTS), 20
    padded = np.zeros((batch, 16), np.int32)
    for row, prompt in enumerate(PROMPTS):
        padded[row, : len(prompt)] = prompt

    @jax.jit
    def user_generate(params, drafter_state, tokens, lens, keys, sampling, stop_ids, limits):
        return speculative_generate(target, nnx.merge(graph, drafter_state), FixedPolicy(GAMMA), params, tokens, lens,
                                    keys, sampling, stop_ids, limits, max_new_tokens=limit, max_len=64)

    out = user_generate(target.params, drafter_state, jnp.asarray(padded), jnp.asarray([len(p) for p in PROMPTS]),
                        request_keys(range(batch)), SamplingParams.broadcast(SamplingConfig(), batch),
                        stop_id_array(()), jnp.full((batch,), limit))
    assert np.asarray(out.tokens_BxN).tolist() == reference.tokens
    assert (np.asarray(out.num_tokens_B) == limit).all() and not np.asarray(out.stopped_B).any()
