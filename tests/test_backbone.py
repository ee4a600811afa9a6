"""Attention-mask semantics of the parallel block drafter backbone (spec §1.6–§1.8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.drafter.backbone import Backbone, ContextCache
from tests.tiny import tiny_config

GAMMA, SEQ = 4, 12


def make(seed=0, num_layers=2, **kw):
    target = tiny_config(qk_norm=True, num_layers=4)
    cfg = DrafterConfig.for_target(target, num_layers=num_layers, tap_layers=(0, 2), mask_token_id=5, block_size=GAMMA,
                                   **kw)
    backbone = Backbone(cfg, rngs=nnx.Rngs(seed))
    embed = jax.random.normal(jax.random.PRNGKey(seed + 1), (cfg.vocab_size, cfg.hidden_size))
    return cfg, backbone, embed


def features(cfg, seed=0, batch=1):
    return jax.random.normal(jax.random.PRNGKey(100 + seed), (batch, SEQ, cfg.context_size))


@pytest.fixture(scope="module")
def setup():
    cfg, backbone, embed = make()
    train = nnx.jit(lambda m, e, f, a, t, k: m.forward_train(e, f, a, t, k))
    return cfg, backbone, embed, train


def run(setup, feats, anchors, tokens, keep=None):
    cfg, backbone, embed, train = setup
    anchors = jnp.asarray([anchors], jnp.int32)
    keep = jnp.ones_like(anchors, bool) if keep is None else jnp.asarray([keep])
    return np.asarray(train(backbone, embed, feats, anchors, jnp.asarray([tokens], jnp.int32), keep))


def test_shapes(setup):
    cfg, *_ = setup
    h = run(setup, features(cfg), [3, 7], [10, 11])
    assert h.shape == (1, 2, GAMMA, cfg.hidden_size) and np.isfinite(h).all()


def perturbed(feats, position):
    return feats.at[:, position].add(5.0)


def test_anchor_feature_and_later_context_are_invisible(setup):
    cfg, *_ = setup
    feats = features(cfg)
    base = run(setup, feats, [6, 9], [10, 11])
    for position in (6, 7, 11):  # the anchor's own feature, later positions
        moved = run(setup, perturbed(feats, position), [6, 9], [10, 11])
        np.testing.assert_array_equal(moved[0, 0], base[0, 0], err_msg=f"position {position}")


def test_earlier_context_is_visible(setup):
    cfg, *_ = setup
    feats = features(cfg)
    base = run(setup, feats, [6, 9], [10, 11])
    for position in (0, 5):
        moved = run(setup, perturbed(feats, position), [6, 9], [10, 11])
        assert np.abs(moved[0, 0] - base[0, 0]).max() > 1e-3, f"position {position} not seen"
    # Block 1 (anchor 9) sees position 8, block 0 (anchor 6) does not.
    moved = run(setup, perturbed(feats, 8), [6, 9], [10, 11])
    np.testing.assert_array_equal(moved[0, 0], base[0, 0])
    assert np.abs(moved[0, 1] - base[0, 1]).max() > 1e-3


def test_blocks_never_see_each_other(setup):
    cfg, *_ = setup
    feats = features(cfg)
    base = run(setup, feats, [6, 9], [10, 11])
    other = run(setup, feats, [6, 9], [10, 40])  # change block 1's anchor token
    np.testing.assert_array_equal(other[0, 0], base[0, 0])
    assert np.abs(other[0, 1] - base[0, 1]).max() > 1e-3
    alone = run(setup, feats, [6], [10])
    np.testing.assert_allclose(alone[0, 0], base[0, 0], atol=1e-5)


def test_attention_inside_a_block_is_bidirectional(setup):
    """The anchor slot's output depends on the anchor token and every slot sees it."""
    cfg, *_ = setup
    feats = features(cfg)
    a = run(setup, feats, [6], [10])
    b = run(setup, feats, [6], [12])
    assert (np.abs(a - b).max(axis=-1) > 1e-4).all()


def test_padding_blocks_are_finite_and_inert(setup):
    cfg, *_ = setup
    feats = features(cfg)
    base = run(setup, feats, [6, 9], [10, 11])
    h = run(setup, feats, [6, 0], [10, 11], keep=[True, False])
    assert np.isfinite(h).all()
    np.testing.assert_array_equal(h[0, 0], base[0, 0])


def test_sliding_window_limits_the_context():
    cfg, backbone, embed = make(sliding_window=3)
    train = nnx.jit(lambda m, e, f, a, t, k: m.forward_train(e, f, a, t, k))
    feats = features(cfg)
    args = (jnp.asarray([[8]]), jnp.asarray([[10]]), jnp.asarray([[True]]))
    base = np.asarray(train(backbone, embed, feats, *args))
    outside = np.asarray(train(backbone, embed, perturbed(feats, 4), *args))
    inside = np.asarray(train(backbone, embed, perturbed(feats, 5), *args))
    np.testing.assert_array_equal(outside, base)
    assert np.abs(inside - base).max() > 1e-3


def test_a_per_slot_window_counts_back_from_each_slot():
    """``window_per_slot`` (z-lab DFlash's sliding layers): a slot at position p sees the context
    and the block's slots from p - window + 1 on. One layer, window 3, anchor 8: slot 0 sees
    context positions 6 and 7, slot 1 only 7, slots 2 and 3 none; slot 3 does not see slot 0."""
    cfg, backbone, embed = make(seed=4, num_layers=1, sliding_window=3, window_per_slot=True)
    train = nnx.jit(lambda m, e, f, a, t, k: m.forward_train(e, f, a, t, k))
    feats = features(cfg)
    args = (jnp.asarray([[8]]), jnp.asarray([[10]]), jnp.asarray([[True]]))
    base = np.asarray(train(backbone, embed, feats, *args))[0, 0]
    for position, seen_by in ((5, []), (6, [0]), (7, [0, 1])):
        moved = np.asarray(train(backbone, embed, perturbed(feats, position), *args))[0, 0]
        changed = [s for s in range(GAMMA) if np.abs(moved[s] - base[s]).max() > 1e-4]
        assert changed == seen_by, (position, changed)
    moved = np.asarray(train(backbone, embed.at[10].add(1.0), feats, *args))[0, 0]  # the anchor's token
    assert [s for s in range(GAMMA) if np.abs(moved[s] - base[s]).max() > 1e-4] == [0, 1, 2]


@pytest.mark.parametrize("window, from_anchor, causal, full, per_slot", [
    (None, True, False, (), False), (3, True, False, (), False), (None, False, False, (), False),
    (3, False, True, (), False), (3, True, True, (1,), False), (3, False, True, (), True), (2, True, False, (0,), True)])
def test_inference_path_equals_training_path(window, from_anchor, causal, full, per_slot):
    """extend_context + forward_block (the decode path) == forward_train for the same block, γ
    drafting slots either way (without ``draft_from_anchor`` the block has one more), its slots
    seeing the whole block or (``block_causal``) those up to their own, in every layer or all but
    the ``full_attention_layers``, the window counted from the anchor or from each slot."""
    cfg, backbone, embed = make(seed=2, sliding_window=window, draft_from_anchor=from_anchor, block_causal=causal,
                                full_attention_layers=full, window_per_slot=per_slot)
    feats = features(cfg, batch=2)
    anchors = jnp.asarray([[7], [4]], jnp.int32)
    tokens = jnp.asarray([[10], [20]], jnp.int32)
    trained = backbone.forward_train(embed, feats, anchors, tokens, jnp.ones((2, 1), bool))
    cache = ContextCache.create(cfg, 2, 32)
    # Context arrives in two chunks of per-row lengths, as it does over decoding rounds.
    cache = backbone.extend_context(cache, feats[:, :3], jnp.asarray([3, 2]))
    rest = jnp.stack([feats[0, 3:7], jnp.concatenate([feats[1, 2:4], jnp.zeros((2, cfg.context_size))])])
    cache = backbone.extend_context(cache, rest, jnp.asarray([4, 2]))
    np.testing.assert_array_equal(cache.lengths_B, [7, 4])
    h = backbone.forward_block(embed, cache, tokens[:, 0])
    assert h.shape == (2, GAMMA, cfg.hidden_size) and cfg.block_slots == GAMMA + (not from_anchor)
    np.testing.assert_allclose(h, trained[:, 0], atol=2e-5, rtol=1e-5)


def test_a_causal_block_hides_later_slots_from_earlier_ones():
    """``block_causal``: the anchor's slot does not see the MASK slots after it, so moving their
    embedding leaves its output as it was; in a bidirectional block, or through one layer exempt
    from it (``full_attention_layers``), it moves it."""
    for causal, full in ((True, ()), (False, ()), (True, (1,))):  # a full-attention layer sees the whole block
        cfg, backbone, embed = make(seed=3, block_causal=causal, full_attention_layers=full)
        train = nnx.jit(lambda m, e, f, a, t, k: m.forward_train(e, f, a, t, k))
        args = (features(cfg), jnp.asarray([[8]]), jnp.asarray([[10]]), jnp.asarray([[True]]))
        base = np.asarray(train(backbone, embed, *args))[0, 0]
        moved = np.asarray(train(backbone, embed.at[cfg.mask_token_id].add(1.0), *args))[0, 0]
        assert (np.abs(moved[0] - base[0]).max() > 1e-3) != (causal and not full), (causal, full)
        assert np.abs(moved[1:] - base[1:]).max() > 1e-3  # the later slots read the moved embedding


def test_block_input_uses_the_frozen_embedding_without_gradient():
    cfg, backbone, embed = make()
    feats = features(cfg)

    def loss(e):
        return backbone.forward_train(e, feats, jnp.asarray([[6]]), jnp.asarray([[10]]), jnp.asarray([[True]])).sum()

    np.testing.assert_array_equal(jax.grad(loss)(embed), 0.0)
