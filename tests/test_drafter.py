"""The assembled DSpark / DFlash drafter: construction, validation, objective, proposal."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.checkpoints.drafter import build_drafter
from dspark_jax.config import DrafterConfig, SamplingConfig
from dspark_jax.drafter.backbone import ContextCache
from dspark_jax.drafter.model import Drafter, select_draft_vocab
from dspark_jax.sampling import SamplingParams, request_keys
from dspark_jax.training.losses import TrainBatch, drafter_loss
from tests.tiny import tiny_config

TARGET = tiny_config(num_layers=4)
GAMMA, SEQ, ANCHORS = 4, 16, 4
DRAFT_IDS = np.arange(0, 97, 2)  # 49 even token ids


def make(kind="dspark", reduced=False, seed=0, **kw):
    if reduced:
        kw["draft_vocab_size"] = len(DRAFT_IDS)
    base = dict(num_layers=1, tap_layers=(0, 2), mask_token_id=5, block_size=GAMMA, markov_rank=8)
    if kind == "dflash":
        base.pop("markov_rank")
        cfg = DrafterConfig.dflash(TARGET, **base, **kw)
    else:
        cfg = DrafterConfig.for_target(TARGET, **base, **kw)
    drafter = Drafter(cfg, rngs=nnx.Rngs(seed), draft_vocab_ids=DRAFT_IDS if reduced else None)
    return cfg, drafter


def head():
    return jax.random.normal(jax.random.PRNGKey(9), (TARGET.vocab_size, TARGET.hidden_size))


def batch(cfg, keep=(True, True, True, False)):
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    ids = jax.random.randint(keys[0], (2, SEQ), 0, cfg.vocab_size)
    return TrainBatch(
        input_ids_BxS=ids,
        loss_mask_BxS=jnp.ones((2, SEQ), jnp.int32).at[:, :3].set(0),
        features_BxSxF=jax.random.normal(keys[1], (2, SEQ, cfg.context_size)),
        target_hidden_BxSxD=jax.random.normal(keys[2], (2, SEQ, cfg.hidden_size)),
        anchors_BxA=jnp.asarray([[2, 5, 9, 0], [3, 4, 13, 0]], jnp.int32),
        keep_BxA=jnp.asarray([keep, keep]),
    )


def loss_and_grads(drafter, embed, data, chunk_size=2):
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)

    def f(params, embed, lm_head):
        model = nnx.merge(graphdef, params, rest)
        return drafter_loss(model, embed, lm_head, data, chunk_size=chunk_size)

    (loss, metrics), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(params, embed, embed)
    return loss, metrics, grads


@pytest.mark.parametrize("kind, reduced, markov", [
    ("dspark", False, "vanilla"), ("dspark", True, "vanilla"), ("dspark", True, "vanilla-draft-rows"),
    ("dspark", False, "rnn"), ("dspark", False, "gated"), ("dflash", False, "none"),
])
def test_gradients_reach_every_drafter_parameter_but_not_the_frozen_head(kind, reduced, markov):
    kw = {} if kind == "dflash" else {"markov_head": markov.removesuffix("-draft-rows")}
    if markov.endswith("-draft-rows"):  # the batch's odd ids are outside the draft vocabulary: the shared row
        kw["markov_w1_rows"] = "draft"
    cfg, drafter = make(kind, reduced, **kw)
    embed = head()
    if reduced:
        drafter.init_draft_head(embed)
    loss, metrics, (g_params, g_embed, g_head) = loss_and_grads(drafter, embed, batch(cfg))
    assert np.isfinite(float(loss)) and float(loss) > 0
    for path, g in jax.tree_util.tree_flatten_with_path(g_params)[0]:
        assert np.isfinite(np.asarray(g)).all(), path
        assert np.abs(np.asarray(g)).max() > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
    np.testing.assert_array_equal(g_embed, 0.0)
    np.testing.assert_array_equal(g_head, 0.0)
    if kind == "dflash":
        assert float(metrics["tv"]) > 0 and cfg.tv_weight == 0.0 and cfg.confidence_weight == 0.0
        np.testing.assert_allclose(loss, metrics["ce"], rtol=1e-6)


def grads_of_same_objective(before, after, embed, data):
    """Assert ``after`` (a function-preserving rebuild of ``before``) has the same loss and metrics
    bit for bit; returns ``after``'s parameter gradients."""
    loss, metrics, _ = loss_and_grads(before, embed, data)
    after_loss, after_metrics, (grads, *_) = loss_and_grads(after, embed, data)
    assert float(after_loss) == float(loss)
    for name in metrics:
        np.testing.assert_array_equal(after_metrics[name], metrics[name], err_msg=name)
    return grads


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_a_deepened_drafter_drafts_as_before_and_trains_its_new_layer(kind):
    cfg, drafter = make(kind, reduced=True)
    embed = head()
    drafter.init_draft_head(embed)
    deeper = drafter.deepened(3, seed=1)
    assert deeper.cfg.backbone.num_layers == 3 and drafter.cfg.backbone.num_layers == 1
    # The appended layers add exact zeros to the residual stream: same objective, bit for bit.
    grads = grads_of_same_objective(drafter, deeper, embed, batch(cfg))
    # The first step moves every new output projection (the rest of a new layer follows once they
    # are non-zero), and the old layer keeps its weights.
    for new in (1, 2):
        for name in ("o", "mlp"):
            g = grads["backbone"]["layers"][new][name]
            g = g["weight"] if name == "o" else g["down"]["weight"]
            assert np.abs(np.asarray(g[...])).max() > 0, (new, name)
    np.testing.assert_array_equal(deeper.backbone.layers[0].q.weight[...], drafter.backbone.layers[0].q.weight[...])
    np.testing.assert_array_equal(deeper.d2t_N, drafter.d2t_N)
    with pytest.raises(ValueError, match="more than this one's 1 layers"):
        drafter.deepened(1)


def draft_only(data):
    """``data`` with every token a draft-vocabulary id (the even ids), so no W1 row is shared."""
    return data._replace(input_ids_BxS=jnp.asarray(DRAFT_IDS)[data.input_ids_BxS % len(DRAFT_IDS)])


def test_a_widened_markov_head_scores_as_before_and_trains_its_new_columns():
    cfg, drafter = make(reduced=True)
    embed = head()
    drafter.init_draft_head(embed)
    wider = drafter.widened_markov(16, seed=1)
    assert wider.cfg.markov_rank == 16 and wider.markov.w1[...].shape == (cfg.vocab_size, 16)
    data = batch(cfg)
    loss, metrics, _ = loss_and_grads(drafter, embed, data)
    wide_loss, wide_metrics, (grads, *_) = loss_and_grads(wider, embed, data)
    # The new columns add exact zeros to the bias and the confidence logit (up to summation order).
    np.testing.assert_allclose(wide_loss, loss, rtol=1e-6)
    for name in metrics:
        np.testing.assert_allclose(wide_metrics[name], metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # The first step moves the new W2 columns and confidence weights (they start at zero).
    assert np.abs(np.asarray(grads["markov"]["w2"]["weight"][...])[:, 8:]).max() > 0
    assert np.abs(np.asarray(grads["confidence"]["proj"]["weight"][...])[:, cfg.hidden_size + 8:]).max() > 0
    np.testing.assert_array_equal(wider.backbone.fc.weight[...], drafter.backbone.fc.weight[...])
    with pytest.raises(ValueError, match="rank above this one's 16"):
        wider.widened_markov(8)
    with pytest.raises(ValueError, match="only a vanilla Markov head"):
        make(reduced=True, markov_head="gated")[1].widened_markov(16)


def test_a_gated_markov_head_from_a_vanilla_one_scores_as_before_and_trains_its_gate():
    cfg, drafter = make(reduced=True, markov_w1_rows="draft")
    embed = head()
    drafter.init_draft_head(embed)
    gated = drafter.gated_markov()
    assert gated.cfg.markov_head == "gated" and drafter.cfg.markov_head == "vanilla"
    # ½ and 2 are powers of two: the same bias, bit for bit.
    grads = grads_of_same_objective(drafter, gated, embed, batch(cfg))
    # The gate's weights see h and W1[x] from the first step on.
    assert np.abs(np.asarray(grads["markov"]["gate"]["weight"][...])[:, :cfg.hidden_size]).max() > 0
    np.testing.assert_array_equal(gated.markov.w1[...], drafter.markov.w1[...])
    with pytest.raises(ValueError, match="only a vanilla Markov head"):
        gated.gated_markov()


def test_draft_w1_rows_give_each_draft_token_its_row_and_share_one_for_the_rest():
    cfg, drafter = make(reduced=True)
    embed = head()
    drafter.init_draft_head(embed)
    drafted = drafter.widened_markov(8, w1_rows="draft", seed=1)
    n = len(DRAFT_IDS)
    assert drafted.markov.w1[...].shape == (n + 1, 8)
    ids = np.arange(cfg.vocab_size)
    expected = np.where(ids % 2 == 0, ids // 2, n)  # DRAFT_IDS are the even ids 0..96
    np.testing.assert_array_equal(drafted.markov.w1_rows(jnp.asarray(ids)), expected)
    old_w1 = np.asarray(drafter.markov.w1[...])
    np.testing.assert_array_equal(drafted.markov.w1[...][:n], old_w1[DRAFT_IDS])
    np.testing.assert_allclose(drafted.markov.w1[...][n], old_w1[ids % 2 == 1].mean(0), rtol=1e-5, atol=1e-7)
    # Where every token has a row of its own, the drafter scores exactly as before.
    data = draft_only(batch(cfg))
    np.testing.assert_allclose(loss_and_grads(drafted, embed, data)[0], loss_and_grads(drafter, embed, data)[0],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="cannot be turned back"):
        drafted.widened_markov(16, w1_rows="target")
    with pytest.raises(ValueError, match="ascending order"):
        Drafter(drafted.cfg, rngs=nnx.Rngs(0), draft_vocab_ids=DRAFT_IDS[::-1].copy())
    with pytest.raises(ValueError, match="needs a Markov head and a draft_vocab_size"):
        make(markov_w1_rows="draft")
    with pytest.raises(ValueError, match="markov_w1_rows must be one of"):
        make(reduced=True, markov_w1_rows="draft_only")


def test_padding_only_batch_has_no_nan():
    cfg, drafter = make()
    loss, metrics, (g_params, *_) = loss_and_grads(drafter, head(), batch(cfg, keep=(False,) * 4))
    assert float(loss) == 0.0
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(g_params))


def test_chunk_size_does_not_change_the_loss():
    cfg, drafter = make()
    data = batch(cfg)
    a = loss_and_grads(drafter, head(), data, chunk_size=1)
    b = loss_and_grads(drafter, head(), data, chunk_size=4)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a[2][0]), jax.tree.leaves(b[2][0])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7)


def test_loss_matches_a_direct_unchunked_computation():
    """The objective's pieces line up: labels at a+s+1, target logits from hidden at a+s."""
    cfg, drafter = make()
    embed = head()
    data = batch(cfg, keep=(True, True, True, True))
    loss, metrics, _ = loss_and_grads(drafter, embed, data)
    anchors = np.asarray(data.anchors_BxA)
    ids = np.asarray(data.input_ids_BxS)
    anchor_tok = np.take_along_axis(ids, anchors, 1)
    h = drafter.backbone.forward_train(embed, data.features_BxSxF, data.anchors_BxA, jnp.asarray(anchor_tok), data.keep_BxA)
    num = den = 0.0
    w = np.exp(-np.arange(GAMMA) / cfg.position_decay)
    for b in range(2):
        for a in range(ANCHORS):
            prev = [anchor_tok[b, a]]
            for s in range(GAMMA):
                j = anchors[b, a] + s + 1
                if j >= SEQ or not data.loss_mask_BxS[b, j]:
                    break
                logits, _ = drafter.teacher_forced(h[b, a, s][None], embed, jnp.asarray(prev[-1:]))
                logits = np.asarray(logits[0], np.float64)
                logz = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
                num += w[s] * (logz - logits[ids[b, j]])
                den += w[s]
                prev.append(ids[b, j])
    np.testing.assert_allclose(metrics["ce"], num / den, rtol=1e-4)


def test_proposal_shapes_and_distribution():
    cfg, drafter = make(reduced=True)
    embed = head()
    drafter.init_draft_head(embed)
    cache = drafter.backbone.extend_context(
        ContextCache.create(cfg, 2, 32), jax.random.normal(jax.random.PRNGKey(1), (2, 6, cfg.context_size)),
        jnp.asarray([6, 4]),
    )
    params = SamplingParams.from_configs([SamplingConfig(), SamplingConfig(temperature=1.0, top_p=0.9)])
    keys = jax.vmap(lambda k: jax.random.split(k, GAMMA))(request_keys([1, 2]))
    block, confidence = drafter.propose(embed, embed, cache, jnp.asarray([3, 8]), params, keys)
    assert block.tokens_BxG.shape == (2, GAMMA) and confidence.shape == (2, GAMMA)
    q = np.asarray(block.q_BxGxV)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    outside = np.setdiff1d(np.arange(cfg.vocab_size), DRAFT_IDS)
    assert (q[..., outside] == 0).all()
    assert np.isin(np.asarray(block.tokens_BxG), DRAFT_IDS).all()
    tokens = np.asarray(block.tokens_BxG)
    assert (np.take_along_axis(q, tokens[..., None], -1) > 0).all()


def test_reduced_head_starts_from_the_target_rows():
    cfg, drafter = make(reduced=True)
    embed = head()
    drafter.init_draft_head(embed)
    np.testing.assert_array_equal(drafter.draft_head.linear.weight[...], np.asarray(embed)[DRAFT_IDS])
    with pytest.raises(ValueError, match="distinct target ids"):
        Drafter(cfg, rngs=nnx.Rngs(0), draft_vocab_ids=np.zeros(len(DRAFT_IDS), int))
    with pytest.raises(ValueError, match="draft_vocab_ids of shape"):
        Drafter(cfg, rngs=nnx.Rngs(0))


def test_select_draft_vocab():
    counts = np.array([5, 0, 9, 9, 1, 7])
    np.testing.assert_array_equal(select_draft_vocab(counts, 3), [2, 3, 5])
    with pytest.raises(ValueError, match="draft vocabulary size"):
        select_draft_vocab(counts, 7)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_size=64), "hidden_size: drafter 48, target 64"),
        (dict(vocab_size=90), "vocab_size: drafter 97, target 90"),
        (dict(num_layers=3), "tap layer 2 is the target's final layer"),
        (dict(num_layers=2), r"tap layer ids \[2\] are outside the target's decoder layers 0..1"),
    ],
)
def test_drafter_that_does_not_fit_its_target_is_refused(change, match):
    cfg, _ = make()
    with pytest.raises(ValueError, match=match):
        cfg.check_target(dataclasses.replace(TARGET, **change))


def test_config_validation():
    with pytest.raises(ValueError, match="mask_token_id 97"):
        DrafterConfig.for_target(TARGET, num_layers=1, tap_layers=(0,), mask_token_id=97)
    with pytest.raises(ValueError, match="final layer"):
        DrafterConfig.for_target(TARGET, num_layers=1, tap_layers=(0, 3), mask_token_id=5)
    with pytest.raises(ValueError, match="confidence_with_markov needs a Markov head"):
        DrafterConfig.for_target(TARGET, num_layers=1, tap_layers=(0,), mask_token_id=5, markov_head="none")
    with pytest.raises(ValueError, match="unknown DrafterConfig keys"):
        DrafterConfig.from_dict({**make()[0].to_dict(), "gamma": 7})
    with pytest.raises(ValueError, match="eagle3_feature_norm, eagle3_norm_output shape an EAGLE-3 drafter's layer, "
                                         "not a dspark one"):
        DrafterConfig.for_target(TARGET, num_layers=1, tap_layers=(0,), mask_token_id=5, eagle3_feature_norm="joint",
                                 eagle3_norm_output=True)
    with pytest.raises(ValueError, match="eagle3_feature_norm must be one of"):
        DrafterConfig.eagle3(TARGET, tap_layers=(0,), mask_token_id=5, eagle3_feature_norm="both")
    with pytest.raises(ValueError, match="eagle3_norm_output must be true or false"):
        DrafterConfig.eagle3(TARGET, tap_layers=(0,), mask_token_id=5, eagle3_norm_output="yes")
    with pytest.raises(ValueError, match="draft_from_anchor=False, block_causal=True shape a block drafter's block "
                                         r"\(dspark, dflash\); the EAGLE-3 drafter drafts step by step"):
        DrafterConfig.eagle3(TARGET, tap_layers=(0,), mask_token_id=5, draft_from_anchor=False, block_causal=True)
    with pytest.raises(ValueError, match="block_causal must be true or false"):
        DrafterConfig.for_target(TARGET, num_layers=1, tap_layers=(0,), mask_token_id=5, block_causal=1)
    with pytest.raises(ValueError, match="full_attention_layers exempt layers from sliding_window and block_causal; "
                                         "neither is set"):
        DrafterConfig.for_target(TARGET, num_layers=2, tap_layers=(0,), mask_token_id=5, full_attention_layers=(1,))
    with pytest.raises(ValueError, match=r"full_attention_layers \[2\] are outside the drafter's layers 0..1"):
        DrafterConfig.for_target(TARGET, num_layers=2, tap_layers=(0,), mask_token_id=5, sliding_window=4,
                                 full_attention_layers=(0, 2))
    with pytest.raises(ValueError, match=r"full_attention_layers must be strictly ascending, got \[1, 0\]"):
        DrafterConfig.for_target(TARGET, num_layers=2, tap_layers=(0,), mask_token_id=5, sliding_window=4,
                                 full_attention_layers=(1, 0))
    with pytest.raises(ValueError, match="window_per_slot says where the sliding window is counted from; "
                                         "sliding_window is not set"):
        DrafterConfig.for_target(TARGET, num_layers=1, tap_layers=(0,), mask_token_id=5, window_per_slot=True)
    with pytest.raises(ValueError, match="window_per_slot=True shape a block drafter's block"):
        DrafterConfig.eagle3(TARGET, tap_layers=(0,), mask_token_id=5, sliding_window=4, window_per_slot=True)
    with pytest.raises(ValueError, match="window_per_slot must be true or false"):
        DrafterConfig.for_target(TARGET, num_layers=1, tap_layers=(0,), mask_token_id=5, sliding_window=4,
                                 window_per_slot="yes")
    cfg, _ = make()
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    # Through config.json, where the layer ids become a list.
    windowed = DrafterConfig.for_target(TARGET, num_layers=2, tap_layers=(0,), mask_token_id=5, sliding_window=4,
                                        block_causal=True, full_attention_layers=(1,), window_per_slot=True)
    assert DrafterConfig.from_dict(json.loads(json.dumps(windowed.to_dict()))) == windowed


def test_drafter_for_the_embedded_target(embedded_target):
    target, tokenizer = embedded_target
    cfg = DrafterConfig.for_target(
        target.cfg, num_layers=1, tap_layers=(1, 8, 15, 22, 28), mask_token_id=tokenizer.unk_token_id,
        draft_vocab_size=8192,
    )
    drafter = Drafter(cfg, rngs=nnx.Rngs(0), draft_vocab_ids=np.arange(8192))
    # 1 layer (≈3.5M) + fc (5·576·576) + Markov W1 (49152·256) + W2 (256·8192) + reduced head + confidence
    assert 20e6 < drafter.num_params < 25e6


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_a_drafter_normalises_q_and_k_as_its_target_does_unless_told(kind):
    """QK-norm follows the target (DeepSpec's drafters are Qwen3 layers, like their targets), and
    ``qk_norm=True`` adds it for a target without. Projections start at N(0, 1/fan_in), not HF's
    N(0, 0.02), which learned slower from scratch here (``docs/TRAINING.md``)."""
    build = {"dspark": DrafterConfig.for_target, "dflash": DrafterConfig.dflash, "eagle3": DrafterConfig.eagle3}[kind]
    layers = {} if kind == "eagle3" else {"num_layers": 1}
    for target_norms, asked, expected in ((False, None, False), (True, None, True), (False, True, True)):
        target = tiny_config(num_layers=4, hidden_size=128, intermediate_size=256, qk_norm=target_norms)
        extra = {} if asked is None else {"qk_norm": asked}
        cfg = build(target, tap_layers=(0, 2), mask_token_id=5, block_size=GAMMA, **layers, **extra)
        drafter = build_drafter(cfg, seed=0)
        attention = drafter if kind == "eagle3" else drafter.backbone.layers[0]
        assert cfg.backbone.qk_norm is expected
        assert (attention.q_norm is not None, attention.k_norm is not None) == (expected, expected)
    out = attention.o.weight[...]
    assert abs(float(jnp.std(out)) * out.shape[1] ** 0.5 - 1) < 0.05


@pytest.mark.parametrize("markov, reduced", [("vanilla", False), ("gated", True), ("rnn", False), ("rnn", True)])
def test_a_proposal_scores_its_tokens_as_training_does(markov, reduced):
    """Spec §2.4-§2.5, §3.1: the corrected logits a block was drawn from and its confidence logits
    are the teacher-forced ones (what training fits) with the drawn tokens as the previous tokens,
    for every head; a padded row of the batch (empty context) changes no other row."""
    cfg, drafter = make(markov_head=markov, reduced=reduced)
    embed = head()
    if reduced:
        drafter.init_draft_head(embed)
    features = jax.random.normal(jax.random.PRNGKey(1), (3, 6, cfg.context_size))
    cache = drafter.extend_context(embed, drafter.new_context(3, 32), features, None, jnp.asarray([6, 0, 4]))
    params = SamplingParams.from_configs([SamplingConfig(temperature=1.0)] * 3)
    keys = jax.vmap(lambda k: jax.random.split(k, GAMMA))(request_keys([1, 2, 3]))
    block, confidence = drafter.propose(embed, embed, cache, jnp.asarray([3, 0, 8]), params, keys)
    assert block.tokens_BxG.dtype == jnp.int32 and confidence.dtype == jnp.float32
    assert block.corrected_logits_BxGxN.shape == (3, GAMMA, len(DRAFT_IDS) if reduced else cfg.vocab_size)
    h = drafter.backbone.forward_block(embed, cache, jnp.asarray([3, 0, 8]))
    logits, expected = drafter.teacher_forced(h, embed, block.prev_tokens_BxG)
    np.testing.assert_allclose(block.corrected_logits_BxGxN, logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(confidence, expected, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(block.q_BxGxV)).all()
    alone = drafter.extend_context(embed, drafter.new_context(1, 32), features[2:], None, jnp.asarray([4]))
    one, conf_one = drafter.propose(embed, embed, alone, jnp.asarray([8]),
                                    SamplingParams.from_configs([SamplingConfig(temperature=1.0)]), keys[2:])
    np.testing.assert_array_equal(one.tokens_BxG, block.tokens_BxG[2:])
    np.testing.assert_allclose(conf_one, confidence[2:], rtol=1e-5, atol=1e-5)
