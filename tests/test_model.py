"""KV-cache semantics of the target forward on tiny random models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.kv_cache import KVCache
from tests.tiny import tiny_config, tiny_target

# Several configurations: plain Llama (tied), Qwen3-style (QK-norm, head_dim != d/H, untied),
# Llama 3 RoPE scaling.
CONFIGS = {
    "llama": {},
    "qwen3": dict(qk_norm=True, head_dim=24, tie_word_embeddings=False, architecture="qwen3"),
    "llama3_rope": dict(
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def target(request):
    return tiny_target(seed=1, **CONFIGS[request.param])


_JITTED = {}


def forward(target, tokens, cache, *, tap_layers=(), **kw):
    """Jitted target.apply (eager op-by-op dispatch is far slower for these many small calls)."""
    key = (id(target), tap_layers)
    if key not in _JITTED:
        _JITTED[key] = jax.jit(lambda p, t, c, **k: target.apply(p, t, c, tap_layers=tap_layers, **k))
    return _JITTED[key](target.params, jnp.asarray(tokens, jnp.int32), cache, **kw)


def tokens_for(batch, steps, vocab=97, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, steps)).astype(np.int32)


def test_shapes_and_taps(target):
    cfg = target.cfg
    out = forward(target, tokens_for(2, 5), target.new_cache(2, 32), tap_layers=(0, 2))
    assert out.logits.shape == (2, 5, cfg.vocab_size)
    assert out.taps.shape == (2, 5, 2 * cfg.hidden_size)
    np.testing.assert_array_equal(out.cache.lengths_B, [5, 5])
    assert not np.isnan(np.asarray(out.logits)).any()
    # Taps are raw layer outputs: tapping the layers one at a time gives the same slices.
    only_two = forward(target, tokens_for(2, 5), target.new_cache(2, 32), tap_layers=(2,))
    np.testing.assert_array_equal(out.taps[..., cfg.hidden_size :], only_two.taps)


def test_tap_layer_validation():
    cfg = tiny_config()
    assert cfg.check_tap_layers((0, 2)) == (0, 2)
    with pytest.raises(ValueError, match="outside"):
        cfg.check_tap_layers((0, 3))
    with pytest.raises(ValueError, match="ascending"):
        cfg.check_tap_layers((2, 0))


def test_prefill_then_decode_equals_full_forward(target):
    tokens = tokens_for(2, 12)
    full = forward(target, tokens, target.new_cache(2, 32), tap_layers=(1,))
    out = forward(target, tokens[:, :8], target.new_cache(2, 32), tap_layers=(1,))
    logits, taps, cache = [out.logits], [out.taps], out.cache
    for t in range(8, 12):
        out = forward(target, tokens[:, t : t + 1], cache, tap_layers=(1,))
        logits.append(out.logits)
        taps.append(out.taps)
        cache = out.cache
    np.testing.assert_allclose(np.concatenate(logits, 1), full.logits, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate(taps, 1), full.taps, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache.lengths_B, [12, 12])


def test_multi_token_step_equals_single_steps(target):
    """Verification runs several new tokens at once; it must agree with one-at-a-time decode."""
    tokens = tokens_for(1, 10, seed=3)
    prefix = forward(target, tokens[:, :6], target.new_cache(1, 32))
    block = forward(target, tokens[:, 6:], prefix.cache)
    cache, singles = prefix.cache, []
    for t in range(6, 10):
        out = forward(target, tokens[:, t : t + 1], cache)
        singles.append(out.logits)
        cache = out.cache
    np.testing.assert_allclose(block.logits, np.concatenate(singles, 1), atol=2e-5, rtol=1e-5)


def test_rollback_then_redecode_equals_fresh_decode(target):
    prompt = tokens_for(2, 7, seed=1)
    wrong, right = tokens_for(2, 3, seed=2), tokens_for(2, 3, seed=4)
    base = forward(target, prompt, target.new_cache(2, 32)).cache
    # Decode a wrong continuation, roll back, decode the right one.
    spoiled = forward(target, wrong, base).cache
    np.testing.assert_array_equal(spoiled.lengths_B, [10, 10])
    rolled = spoiled.rollback(jnp.asarray([7, 7]))
    again = forward(target, right, rolled)
    fresh = forward(target, right, forward(target, prompt, target.new_cache(2, 32)).cache)
    np.testing.assert_allclose(again.logits, fresh.logits, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(again.cache.lengths_B, [10, 10])


def test_partial_rollback_per_row(target):
    """Rows roll back to different lengths (as after different accept lengths)."""
    prompt = tokens_for(2, 6, seed=5)
    draft = tokens_for(2, 4, seed=6)
    after = forward(target, draft, forward(target, prompt, target.new_cache(2, 32)).cache).cache
    keep = np.array([1, 3])  # row 0 keeps 1 drafted token, row 1 keeps 3
    rolled = after.rollback(jnp.asarray(6 + keep))
    nxt = tokens_for(2, 1, seed=7)
    out = forward(target, nxt, rolled)
    for row in range(2):
        seq = np.concatenate([prompt[row], draft[row, : keep[row]], nxt[row]])[None]
        ref = forward(target, seq, target.new_cache(1, 32))
        np.testing.assert_allclose(out.logits[row, 0], ref.logits[0, -1], atol=2e-5, rtol=1e-5)


def test_rollback_never_grows():
    cache = KVCache.create(tiny_config(), 2, 8)._replace(lengths_B=jnp.asarray([3, 5]))
    np.testing.assert_array_equal(cache.rollback(jnp.asarray([4, 2])).lengths_B, [3, 2])


def test_batched_rows_with_different_lengths_equal_unbatched(target):
    lengths = [5, 9, 3]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 97, size=n).astype(np.int32) for n in lengths]
    padded = np.zeros((3, 9), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lens = jnp.asarray(lengths, jnp.int32)
    out = forward(target, padded, target.new_cache(3, 32), n_new_B=lens, logits_at_B=lens - 1)
    np.testing.assert_array_equal(out.cache.lengths_B, lengths)
    nxt = tokens_for(3, 2, seed=12)
    step = forward(target, nxt, out.cache)
    for i, p in enumerate(prompts):
        single = forward(target, p[None], target.new_cache(1, 32))
        np.testing.assert_allclose(out.logits[i], single.logits[0, -1], atol=2e-5, rtol=1e-5)
        single_step = forward(target, nxt[i : i + 1], single.cache)
        np.testing.assert_allclose(step.logits[i], single_step.logits[0], atol=2e-5, rtol=1e-5)


def test_fully_masked_padding_row_is_finite(target):
    """A row with zero new tokens (a frozen slot) must not produce NaN anywhere."""
    out = forward(
        target, tokens_for(2, 4), target.new_cache(2, 16), n_new_B=jnp.asarray([4, 0], jnp.int32)
    )
    assert np.isfinite(np.asarray(out.logits)).all()
    np.testing.assert_array_equal(out.cache.lengths_B, [4, 0])


def test_writes_past_cache_end_are_dropped(target):
    cache = target.new_cache(1, 8)._replace(lengths_B=jnp.asarray([6], jnp.int32))
    out = forward(target, tokens_for(1, 4), cache)
    assert np.isfinite(np.asarray(out.logits[:, :2])).all()


def test_jit_of_apply_is_pure(target):
    """apply is a pure function of (params, tokens, cache): usable inside a user's jax.jit."""
    step = jax.jit(lambda p, t, c: target.apply(p, t, c).logits)
    tokens = jnp.asarray(tokens_for(1, 3))
    a = step(target.params, tokens, target.new_cache(1, 16))
    scaled = [p * 0.5 if p.ndim == 2 else p for p in target.params]
    b = step(scaled, tokens, target.new_cache(1, 16))
    assert not np.allclose(a, b)
