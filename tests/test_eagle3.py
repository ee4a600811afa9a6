"""EAGLE-3 baseline: the TTT training pass equals step-by-step cached inference (spec §8.2)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, SamplingConfig
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
    hidden = train_forward(model)(embed, feats, tokens)
    return cfg, model, embed, feats, tokens, hidden


def train_forward(model):
    """``model.forward_train`` jitted, the weights as arguments (eagerly, every op of the TTT
    steps would compile on its own)."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda params, *args: nnx.merge(graphdef, params).forward_train(*args))
    return lambda *args: forward(params, *args)


def test_config_is_one_layer_autoregressive_by_default():
    target = tiny_config(num_layers=4)
    cfg = DrafterConfig.eagle3(target, tap_layers=(0, 2), mask_token_id=5)
    assert cfg.backbone.num_layers == 1 and cfg.markov_head == "none" and not cfg.confidence_head
    assert len(Eagle3Drafter(cfg, rngs=nnx.Rngs(0)).later_layers) == 0
    # Deeper, as speculators and vLLM stack them: a cache layer for each.
    deeper = Eagle3Drafter(dataclasses.replace(cfg, backbone=dataclasses.replace(cfg.backbone, num_layers=3)),
                           rngs=nnx.Rngs(0))
    assert len(deeper.later_layers) == 2 and len(deeper.new_cache(1, 8).keys) == 3


def test_shapes(setup):
    cfg, model, embed, feats, tokens, hidden = setup
    assert hidden.shape == (STEPS, 1, SEQ, cfg.hidden_size)
    assert model.logits(hidden, embed).shape == (STEPS, 1, SEQ, cfg.vocab_size)


@pytest.mark.parametrize("t", [0, 4, 6])
def test_ttt_steps_equal_cached_autoregressive_inference(setup, t):
    cfg, model, embed, feats, tokens, hidden = setup
    ttt_equals_cached(model, embed, feats, tokens, hidden, t)


# speculators' EAGLE-3 options (checkpoints.speculators reads them): a sliding window of 3
# positions, shorter than the TTT steps' reach, every norm variant, and a second layer.
VARIANTS = {
    "speculators_defaults": dict(eagle3_feature_norm="joint", eagle3_norm_before_residual=True,
                                 eagle3_norm_output=True, sliding_window=3),
    "per_layer_norms": dict(eagle3_feature_norm="per_layer", sliding_window=2),
    "two_layers": dict(num_layers=2, eagle3_norm_before_residual=True, sliding_window=3),
    "full_second_layer": dict(num_layers=2, sliding_window=2, full_attention_layers=(1,)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculators_variants_train_as_they_draft(variant):
    """Each variant's TTT pass equals cached inference step by step (the window counts positions
    in both), every parameter gets a gradient, and the window and norms change the output."""
    cfg = DrafterConfig.eagle3(tiny_config(qk_norm=True, num_layers=4), tap_layers=(0, 2), mask_token_id=5,
                               block_size=4, **VARIANTS[variant])
    model = Eagle3Drafter(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    # Every weight moved at random (each its own way; the norms away from 1), so that a norm
    # applied in the wrong place shows.
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(9), len(leaves))
    params = jax.tree.unflatten(treedef, [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
    model = nnx.merge(graphdef, params)
    embed = jax.random.normal(jax.random.PRNGKey(1), (cfg.vocab_size, cfg.hidden_size))
    feats = jax.random.normal(jax.random.PRNGKey(2), (1, SEQ, cfg.context_size))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (1, SEQ), 0, cfg.vocab_size)

    def forward(drafter_cfg):
        """The TTT hidden states of this model's weights under ``drafter_cfg``."""
        other = Eagle3Drafter(drafter_cfg, rngs=nnx.Rngs(0))
        nnx.update(other, params)
        return train_forward(other)(embed, feats, tokens)

    hidden = forward(cfg)
    for t in (0, 5):  # past the window at 5
        ttt_equals_cached(model, embed, feats, tokens, hidden, t)

    def loss(params):
        drafter = nnx.merge(graphdef, params)
        return jnp.sum(drafter.logits(drafter.forward_train(embed, feats, tokens), embed) ** 2)

    for path, g in jax.tree_util.tree_flatten_with_path(jax.jit(jax.grad(loss))(params))[0]:
        assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)
    # The same weights with one option off: another output (the golden tests in test_speculators
    # check each against speculators' own forward).
    for option, off in (("full_attention_layers", ()), ("sliding_window", None), ("eagle3_norm_before_residual", False),
                        ("eagle3_norm_output", False)):
        if getattr(cfg, option) != off:
            other = forward(dataclasses.replace(cfg, **{option: off, "full_attention_layers": ()}))
            assert np.abs(np.asarray(other - hidden)).max() > 1e-3, option


def ttt_equals_cached(model, embed, feats, tokens, hidden, t):
    """The TTT pass's step-k output at index t is cached inference's k-th proposal step after
    committing positions 0..t (the whole chain in one jitted call: eagerly, each op would compile
    on its own)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def chain(params):
        model = nnx.merge(graphdef, params)
        g = model.project_features(feats[:, : t + 1])
        out, cache = model.forward_cached(g, tokens[:, 1 : t + 2], embed, model.new_cache(1, 32))
        h, outputs = out[:, t : t + 1], [out[0, t]]
        for k in range(1, hidden.shape[0]):
            h, cache = model.forward_cached(h, tokens[:, t + 1 + k : t + 2 + k], embed, cache)
            outputs.append(h[0, 0])
        return jnp.stack(outputs)

    np.testing.assert_allclose(chain(params), hidden[:, 0, t], atol=2e-5, rtol=1e-5)


def test_step_k_does_not_see_later_positions(setup):
    cfg, model, embed, feats, tokens, hidden = setup
    moved = train_forward(model)(embed, feats.at[:, 6:].add(3.0), tokens)  # as `hidden` was computed
    np.testing.assert_array_equal(moved[:, :, :6], hidden[:, :, :6])
    assert np.abs(moved[:, :, 6:] - hidden[:, :, 6:]).max() > 1e-3


def test_ttt_loss_gradients_and_value(setup):
    """The loss is scored at the sampled anchors: anchor ``a`` is TTT index ``a − 1``, step k
    predicts token ``a + 1 + k`` (DSpark's slot k); padding anchors, anchor 0 and prompt labels
    add nothing to the sum (the normaliser counts kept anchors)."""
    from dspark_jax.training.losses import TrainBatch, eagle3_loss

    cfg, model, embed, feats, tokens, hidden = setup
    loss_mask = jnp.ones((1, SEQ), jnp.int32).at[:, 6].set(0)  # a prompt-like token at 6
    target_hidden = jax.random.normal(jax.random.PRNGKey(5), (1, SEQ, cfg.hidden_size))
    anchors = np.asarray([[2, 4, 5, 7, 8, 0]], np.int32)
    keep = np.asarray([[True, True, False, True, True, True]])  # anchor 0 kept: it has no index a-1
    data = TrainBatch(tokens, loss_mask, feats, target_hidden, jnp.asarray(anchors), jnp.asarray(keep))
    graphdef, params = nnx.split(model)

    def f(params, embed, head):
        return eagle3_loss(nnx.merge(graphdef, params), embed, head, data)

    (loss, metrics), (g_params, g_embed, g_head) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        params, embed, embed
    )
    for path, g in jax.tree_util.tree_flatten_with_path(g_params)[0]:
        assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(g_embed, 0.0)
    np.testing.assert_array_equal(g_head, 0.0)
    # Step 1 by hand: anchor a (index t = a-1) predicts token a+2 against softmax(head(target_hidden[a+1])).
    logits = np.asarray(model.logits(hidden[1], embed))[0].astype(np.float64)
    target = np.asarray(target_hidden[0] @ embed.T, np.float64)
    total, scored = 0.0, 0
    for a, kept in zip(anchors[0], keep[0]):
        if kept and a >= 1 and a + 2 < SEQ and loss_mask[0, a + 2]:
            p = np.exp(target[a + 1] - target[a + 1].max())
            p /= p.sum()
            log_q = logits[a - 1] - logits[a - 1].max()
            log_q -= np.log(np.exp(log_q).sum())
            total -= (p * log_q).sum()
            scored += 1
    # Anchors 2 (label 4) and 7 (label 9); 4's label is masked, 5 is padding, 8's label is past
    # the end, and 0 has no TTT index before it.
    assert scored == 2
    np.testing.assert_allclose(metrics["step_loss"][1], total / keep.sum(), rtol=1e-4)
    weights = cfg.ttt_step_decay ** np.arange(STEPS)
    np.testing.assert_allclose(loss, (weights * np.asarray(metrics["step_loss"])).sum(), rtol=1e-5)


def test_reduced_head_loss_and_proposal(setup):
    """A reduced-vocabulary EAGLE-3 head: the lse-based loss equals the full-logit one, and
    proposals are draft-vocabulary tokens with q zero elsewhere."""
    from dspark_jax.drafter.heads import DraftBlock
    from dspark_jax.sampling import SamplingParams
    from dspark_jax.training.losses import TrainBatch, eagle3_loss

    cfg, _, embed, feats, tokens, _ = setup
    ids = np.arange(0, cfg.vocab_size, 2)
    reduced_cfg = DrafterConfig.eagle3(tiny_config(qk_norm=True, num_layers=4), tap_layers=(0, 2), mask_token_id=5,
                                       block_size=STEPS, draft_vocab_size=ids.size)
    model = Eagle3Drafter(reduced_cfg, rngs=nnx.Rngs(0), draft_vocab_ids=ids)
    model.init_draft_head(embed)
    np.testing.assert_array_equal(model.draft_head.linear.weight[...], np.asarray(embed)[ids])
    target_hidden = jax.random.normal(jax.random.PRNGKey(5), (1, SEQ, cfg.hidden_size))
    lse = jax.nn.logsumexp(target_hidden @ embed.T, axis=-1)
    mask = jnp.ones((1, SEQ), jnp.int32).at[:, :4].set(0)
    anchors = (jnp.arange(1, SEQ, dtype=jnp.int32)[None], jnp.ones((1, SEQ - 1), bool))
    loss = nnx.jit(eagle3_loss)  # eagerly, every op of the TTT steps would compile on its own
    full = loss(model, embed, embed, TrainBatch(tokens, mask, feats, target_hidden, *anchors))
    via_lse = loss(model, embed, embed, TrainBatch(tokens, mask, feats, target_hidden, *anchors, lse))
    np.testing.assert_allclose(via_lse[0], full[0], rtol=1e-5)
    np.testing.assert_allclose(via_lse[1]["accept_rate"], full[1]["accept_rate"], rtol=1e-5)

    context = model.new_context(1, 32)
    context = model.extend_context(embed, context, feats[:, :6], tokens[:, 1:7], jnp.asarray([6]))
    params = SamplingParams.from_configs([SamplingConfig(temperature=1.0)])
    block, confidence = model.propose(embed, embed, context, tokens[:, 6], params,
                                      jax.random.split(jax.random.PRNGKey(7), STEPS)[None])
    assert isinstance(block, DraftBlock) and confidence is None
    assert np.isin(np.asarray(block.tokens_BxG), ids).all()
    q = np.asarray(block.q_BxGxV)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    assert (q[..., 1::2] == 0).all()


def test_ttt_acceptance_metrics_are_per_anchor_chains(setup):
    """EAGLE-3's analytic τ chains each anchor's steps like a DSpark block (mean of products,
    not product of means), and its greedy τ stops at the first step whose argmax misses."""
    from dspark_jax.training.losses import TrainBatch, eagle3_loss
    from tests.test_losses import np_softmax

    cfg, model, embed, feats, _, _ = setup
    # Tokens chosen left to right so that at every other index t step 0 (which holds tokens[t+1])
    # predicts tokens[t+2]: those anchors' greedy chains pass slot 0, the others (mostly) stop there.
    tokens = np.array(jax.random.randint(jax.random.PRNGKey(3), (1, SEQ), 0, cfg.vocab_size))
    for t in range(0, SEQ - 2, 2):
        step0 = model.forward_train(embed, feats, jnp.asarray(tokens), steps=1)
        tokens[0, t + 2] = int(np.argmax(np.asarray(model.logits(step0[0], embed))[0, t]))
    tokens = jnp.asarray(tokens)
    hidden = model.forward_train(embed, feats, tokens)
    target_hidden = jax.random.normal(jax.random.PRNGKey(5), (1, SEQ, cfg.hidden_size))
    anchors = np.arange(1, SEQ - 1, dtype=np.int32)[None]
    data = TrainBatch(tokens, jnp.ones((1, SEQ), jnp.int32), feats, target_hidden, jnp.asarray(anchors),
                      jnp.ones(anchors.shape, bool))
    _, metrics = eagle3_loss(model, embed, embed, data)

    logits = np.asarray(model.logits(hidden, embed))[:, 0]  # [K, S, V]
    target = np_softmax(np.asarray(target_hidden[0] @ embed.T))
    taus, greedy_taus = [], []
    for a in anchors[0]:
        tau, chain, greedy, alive = 1.0, 1.0, 1.0, True
        for k in range(STEPS):
            if a + 1 + k >= SEQ:
                break
            q = np_softmax(logits[k, a - 1])
            chain *= np.minimum(q, target[a + k]).sum()
            tau += chain
            alive = alive and q.argmax() == int(tokens[0, a + 1 + k])
            greedy += alive
        taus.append(tau)
        greedy_taus.append(greedy)
    assert 1 < np.mean(greedy_taus) < 2.5
    np.testing.assert_allclose(metrics["tau_probabilistic"], np.mean(taus), rtol=1e-4)
    np.testing.assert_allclose(metrics["tau_greedy"], np.mean(greedy_taus), rtol=1e-6)
