"""EAGLE-3 baseline: the TTT training pass equals step-by-step cached inference (spec §8.2)."""

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafter.eagle3 import Eagle3Drafter
from tests.tiny import tiny_config

SEQ, STEPS = 10, 3


@pytest.fixture(scope="module")
def setup():
    target = tiny_config(qk_norm=True, num_layers=4)
    cfg = DrafterConfig.eagle3(target, tap_layers=(0, 2), mask_token_id=5, block_size=STEPS)
    model = Eagle3Drafter(cfg, rngs=nnx.Rngs(0))
    embed = jax.random.normal(jax.random.PRNGKey(1), (cfg.vocab_size, cfg.hidden_size))
    feats = jax.random.normal(jax.random.PRNGKey(2), (1, SEQ, cfg.context_size))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (1, SEQ), 0, cfg.vocab_size)
    hidden = model.forward_train(embed, feats, tokens)
    return cfg, model, embed, feats, tokens, hidden


def test_config_is_one_layer_autoregressive():
    target = tiny_config(num_layers=4)
    cfg = DrafterConfig.eagle3(target, tap_layers=(0, 2), mask_token_id=5)
    assert cfg.backbone.num_layers == 1 and cfg.markov_head == "none" and not cfg.confidence_head
    with pytest.raises(ValueError, match="exactly one layer"):
        Eagle3Drafter(DrafterConfig.for_target(target, num_layers=2, tap_layers=(0,), mask_token_id=5), rngs=nnx.Rngs(0))


def test_shapes(setup):
    cfg, model, embed, feats, tokens, hidden = setup
    assert hidden.shape == (STEPS, 1, SEQ, cfg.hidden_size)
    assert model.logits(hidden, embed).shape == (STEPS, 1, SEQ, cfg.vocab_size)


@pytest.mark.parametrize("t", [0, 4, 6])
def test_ttt_steps_equal_cached_autoregressive_inference(setup, t):
    cfg, model, embed, feats, tokens, hidden = setup
    cache = model.new_cache(1, 32)
    g = model.project_features(feats[:, : t + 1])
    out, cache = model.forward_cached(g, tokens[:, 1 : t + 2], embed, cache)
    np.testing.assert_allclose(out[0, t], hidden[0, 0, t], atol=2e-5, rtol=1e-5)
    h = out[:, t : t + 1]
    for k in range(1, STEPS):
        h, cache = model.forward_cached(h, tokens[:, t + 1 + k : t + 2 + k], embed, cache)
        np.testing.assert_allclose(h[0, 0], hidden[k, 0, t], atol=2e-5, rtol=1e-5, err_msg=f"step {k}")


def test_step_k_does_not_see_later_positions(setup):
    cfg, model, embed, feats, tokens, hidden = setup
    moved = model.forward_train(embed, feats.at[:, 6:].add(3.0), tokens)
    np.testing.assert_array_equal(moved[:, :, :6], hidden[:, :, :6])
    assert np.abs(moved[:, :, 6:] - hidden[:, :, 6:]).max() > 1e-3
