"""DSpark losses (spec §3.2, §4) and analytic τ metrics (§4.7), checked against hand / numpy values."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.eval.metrics import (
    acceptance_probability,
    expected_tau,
    expected_tau_from_tv,
    total_variation,
)
from dspark_jax.training.losses import (
    block_label_mask,
    block_labels,
    block_losses,
    chunked_block_losses,
    combine,
    position_weights,
    supervision_mask,
)


def make_cfg(**kw):
    """The loss fields of DrafterConfig (defaults as there); a namespace keeps the test light."""
    base = dict(ce_weight=0.1, tv_weight=0.9, confidence_weight=1.0, position_decay=4.0, tv_half=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_cfg_defaults_match_drafter_config():
    import dataclasses

    from dspark_jax.config import DrafterConfig

    defaults = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}
    for name, value in vars(make_cfg()).items():
        assert defaults[name] == value, name


# ---------------------------------------------------------------------------------------------
# numpy reference (independent of the implementation)
# ---------------------------------------------------------------------------------------------


def np_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_reference(draft, target, labels, mask, conf, cfg, d2t=None):
    """Loop-based reference: scatter p_d into V, CE over the draft vocab, BCE vs c*."""
    draft, target = np.asarray(draft, np.float64), np.asarray(target, np.float64)
    v = target.shape[-1]
    d2t = np.arange(v) if d2t is None else np.asarray(d2t)
    acc = {k: 0.0 for k in ("ce_n", "ce_d", "tv_n", "tv_d", "cf_n", "excl")}
    for idx in np.ndindex(*draft.shape[:-1]):
        if not mask[idx]:
            continue
        w = math.exp(-idx[-1] / cfg.position_decay)
        p_d_small = np_softmax(draft[idx])
        p_d = np.zeros(v)
        p_d[d2t] = p_d_small
        p_t = np_softmax(target[idx])
        l1 = np.abs(p_d - p_t).sum()
        acc["tv_n"] += w * (0.5 * l1 if cfg.tv_half else l1)
        acc["tv_d"] += w
        hit = np.nonzero(d2t == labels[idx])[0]
        if len(hit):
            acc["ce_n"] += w * -math.log(p_d_small[hit[0]])
            acc["ce_d"] += w
        else:
            acc["excl"] += 1
        c = min(max(1 - 0.5 * l1, 0.0), 1.0)
        z = float(conf[idx])
        s = 1 / (1 + math.exp(-z))
        acc["cf_n"] += w * -(c * math.log(s) + (1 - c) * math.log(1 - s))
    ce = acc["ce_n"] / acc["ce_d"] if acc["ce_d"] else 0.0
    tv = acc["tv_n"] / acc["tv_d"] if acc["tv_d"] else 0.0
    cf = acc["cf_n"] / acc["tv_d"] if acc["tv_d"] else 0.0
    loss = cfg.ce_weight * ce + cfg.tv_weight * tv + cfg.confidence_weight * cf
    return dict(ce=ce, tv=tv, conf=cf, loss=loss, excluded=acc["excl"], **np_chains(draft, target, labels, mask, d2t))


def np_chains(draft, target, labels, mask, d2t):
    """Block by block: τ of speculative sampling (Σ_k Π c*) and of greedy drafting, which
    stops at the first slot whose draft argmax is not the label; per-slot conditional hits."""
    v = target.shape[-1]
    taus, greedy_taus = [], []
    reached, hits = np.zeros(draft.shape[-2]), np.zeros(draft.shape[-2])
    for block in np.ndindex(*draft.shape[:-2]):
        if not mask[block][0]:
            continue
        tau, chain, greedy, alive = 1.0, 1.0, 1.0, True
        for s in range(draft.shape[-2]):
            if not mask[block][s]:
                break
            p_d = np.zeros(v)
            p_d[d2t] = np_softmax(draft[block][s])
            chain *= np.minimum(p_d, np_softmax(target[block][s])).sum()
            tau += chain
            if alive:
                reached[s] += 1
                alive = d2t[np.argmax(draft[block][s])] == labels[block][s]
                hits[s] += alive
                greedy += alive
        taus.append(tau)
        greedy_taus.append(greedy)
    with np.errstate(invalid="ignore"):
        conditional = np.where(reached > 0, hits / np.maximum(reached, 1), 0.0)
    return dict(tau_probabilistic=np.mean(taus), tau_greedy=np.mean(greedy_taus), greedy_conditional_accept=conditional)


def run_losses(draft, target, labels, mask, conf, cfg, d2t=None):
    d2t = None if d2t is None else jnp.asarray(d2t)

    @jax.jit  # one compile instead of op-by-op dispatch (keeps the suite fast on shared CPUs)
    def fn(draft, target, labels, mask, conf):
        parts = block_losses(draft, target, labels, mask, conf, cfg, d2t)
        return parts, combine(parts, cfg)

    return fn(
        jnp.asarray(draft, jnp.float32),
        jnp.asarray(target, jnp.float32),
        jnp.asarray(labels),
        jnp.asarray(mask),
        None if conf is None else jnp.asarray(conf, jnp.float32),
    )


# ---------------------------------------------------------------------------------------------
# Weights and masks
# ---------------------------------------------------------------------------------------------


def test_position_weights_decay_4():
    # The spec's table for decay 4.0 (γ = 7).
    expected = [1.0, 0.779, 0.607, 0.472, 0.368, 0.287, 0.223]
    np.testing.assert_allclose(position_weights(7, 4.0), expected, atol=6e-4)
    np.testing.assert_allclose(position_weights(3, 2.0), [1.0, math.exp(-0.5), math.exp(-1.0)], rtol=1e-6)


def test_supervision_mask_is_cumulative():
    valid = np.array([[1, 0, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]], bool)
    expected = np.array([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(supervision_mask(valid), expected)


def test_block_label_mask_hand_case():
    loss_mask = np.array([[0, 1, 1, 1, 0, 1]])  # S = 6
    anchors = np.array([[1, 4, 2, 0]])
    keep = np.array([[True, True, True, False]])
    got = block_label_mask(jnp.asarray(loss_mask), jnp.asarray(anchors), jnp.asarray(keep), 3)
    expected = np.array([[
        [1, 1, 0],  # labels at 2,3,4: loss_mask 1,1,0
        [1, 0, 0],  # labels at 5,6,7: 5 ok, 6 and 7 are past the sequence end
        [1, 0, 0],  # labels at 3,4,5: the 0 at 4 kills 5 (cumulative)
        [0, 0, 0],  # not kept
    ]], bool)
    np.testing.assert_array_equal(got, expected)
    labels = block_labels(jnp.arange(10, 16)[None], jnp.asarray(anchors), 3)
    np.testing.assert_array_equal(labels[0, 0], [12, 13, 14])


# ---------------------------------------------------------------------------------------------
# Loss values
# ---------------------------------------------------------------------------------------------

LN2, LN3 = math.log(2.0), math.log(3.0)
W1 = math.exp(-0.25)


def hand_inputs():
    """V = 3, γ = 2, one block; every number below is worked out by hand.

    slot 0: draft logits 0 → p_d uniform; target p_t = [.5,.25,.25]; label 1
            CE = ln 3, L1 = 1/6 + 2·(1/12) = 1/3, c* = 1 − 1/6 = 5/6, z = 0 → BCE = ln 2
    slot 1: draft = target = [ln 2, 0, 0] → p = [.5,.25,.25]; label 0
            CE = ln 2, L1 = 0, c* = 1, z = 0 → BCE = ln 2
    """
    draft = np.array([[[0.0, 0.0, 0.0], [LN2, 0.0, 0.0]]])
    target = np.array([[[LN2, 0.0, 0.0], [LN2, 0.0, 0.0]]])
    labels = np.array([[1, 0]])
    mask = np.array([[True, True]])
    conf = np.zeros((1, 2))
    return draft, target, labels, mask, conf


def test_hand_values():
    cfg = make_cfg()
    parts, (loss, m) = run_losses(*hand_inputs(), cfg)
    ce = (LN3 + W1 * LN2) / (1 + W1)
    tv = (1 / 3) / (1 + W1)
    conf = LN2
    np.testing.assert_allclose(m["ce"], ce, rtol=1e-6)
    np.testing.assert_allclose(m["tv"], tv, rtol=1e-6)
    np.testing.assert_allclose(m["conf"], conf, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.1 * ce + 0.9 * tv + 1.0 * conf, rtol=1e-6)
    np.testing.assert_allclose(m["accept_rate"], [5 / 6, 1.0], rtol=1e-6)
    np.testing.assert_allclose(m["tau_probabilistic"], 1 + 5 / 6 + 5 / 6, rtol=1e-6)
    np.testing.assert_allclose(parts["tv_den"], 1 + W1, rtol=1e-6)
    assert float(m["ce_excluded"]) == 0 and float(m["supervised"]) == 2


def test_hand_values_nonzero_confidence_logit():
    # slot 0 with z = ln 3 (σ = 3/4), c* = 5/6: BCE = −(5/6)ln(3/4) − (1/6)ln(1/4); slot 1 masked.
    draft, target, labels, _, _ = hand_inputs()
    mask = np.array([[True, False]])
    conf = np.array([[LN3, 5.0]])
    _, (_, m) = run_losses(draft, target, labels, mask, conf, make_cfg())
    np.testing.assert_allclose(m["conf"], -(5 / 6) * math.log(3 / 4) - (1 / 6) * math.log(1 / 4), rtol=1e-6)
    np.testing.assert_allclose(m["tv"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["ce"], LN3, rtol=1e-6)
    np.testing.assert_allclose(m["confidence_bias"], 3 / 4 - 5 / 6, rtol=1e-5)
    np.testing.assert_allclose(m["tau_probabilistic"], 1 + 5 / 6, rtol=1e-6)


def test_confidence_diagnostics_are_weighted_by_position_as_the_bce():
    # Slot 0: σ = 3/4 against c* = 5/6; slot 1 (weight W1): σ = 1/2 against c* = 1. DeepSpec
    # weights the logged errors like the BCE, so its numbers and ours compare.
    draft, target, labels, mask, _ = hand_inputs()
    _, (_, m) = run_losses(draft, target, labels, mask, np.array([[LN3, 0.0]]), make_cfg())
    np.testing.assert_allclose(m["confidence_abs_error"], (1 / 12 + W1 / 2) / (1 + W1), rtol=1e-5)
    np.testing.assert_allclose(m["confidence_bias"], (-1 / 12 - W1 / 2) / (1 + W1), rtol=1e-5)
    np.testing.assert_allclose(m["confidence_cumprod_bias"], (-1 / 12 + W1 * (3 / 8 - 5 / 6)) / (1 + W1), rtol=1e-5)


def test_tv_half_toggles_only_tv():
    inputs = hand_inputs()
    _, (_, full) = run_losses(*inputs, make_cfg(tv_half=False))
    _, (_, half) = run_losses(*inputs, make_cfg(tv_half=True))
    np.testing.assert_allclose(half["tv"], 0.5 * full["tv"], rtol=1e-6)
    for key in ("ce", "conf", "accept_rate", "tau_probabilistic"):
        np.testing.assert_allclose(half[key], full[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(half["loss"] - full["loss"], -0.9 * 0.5 * full["tv"], rtol=1e-5)


@pytest.mark.parametrize("tv_half", [False, True])
def test_random_matches_numpy_reference(tv_half):
    rng = np.random.default_rng(0)
    b, a, g, v = 2, 3, 4, 5
    draft = rng.normal(size=(b, a, g, v)) * 2
    target = rng.normal(size=(b, a, g, v)) * 2
    # Most labels are the draft's argmax, so greedy chains run several slots.
    labels = np.where(rng.random((b, a, g)) < 0.7, draft.argmax(-1), rng.integers(0, v, size=(b, a, g)))
    mask = np.asarray(supervision_mask(rng.random((b, a, g)) < 0.8))
    conf = rng.normal(size=(b, a, g))
    cfg = make_cfg(tv_half=tv_half, ce_weight=0.3, tv_weight=0.5, confidence_weight=0.7)
    _, (loss, m) = run_losses(draft, target, labels, mask, conf, cfg)
    ref = np_reference(draft, target, labels, mask, conf, cfg)
    assert ref["tau_greedy"] > 1.5 and 0 < ref["greedy_conditional_accept"][1] < 1
    for key in ("ce", "tv", "conf", "loss", "tau_probabilistic", "tau_greedy", "greedy_conditional_accept"):
        np.testing.assert_allclose(m[key], ref[key], rtol=2e-5, err_msg=key)


def test_reduced_vocab_scatter_and_ce_exclusion():
    # V = 4, N = 2, draft index 0 → target 2, draft index 1 → target 0.
    d2t = np.array([2, 0])
    draft = np.zeros((1, 2, 2))  # p_d = [.5, .5] → p_d in V = [.5, 0, .5, 0]
    target = np.zeros((1, 2, 4))  # p_t uniform .25 → L1 = 4 × .25 = 1
    labels = np.array([[0, 3]])  # 0 is draft index 1 (CE ln 2); 3 is outside the draft vocab
    mask = np.array([[True, True]])
    conf = np.zeros((1, 2))
    parts, (_, m) = run_losses(draft, target, labels, mask, conf, make_cfg(), d2t)
    np.testing.assert_allclose(m["tv"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(m["ce"], LN2, rtol=1e-6)
    np.testing.assert_allclose(parts["ce_den"], 1.0, rtol=1e-6)  # slot 1 dropped from CE only
    np.testing.assert_allclose(parts["tv_den"], 1 + W1, rtol=1e-6)
    np.testing.assert_allclose(parts["conf_den"], 1 + W1, rtol=1e-6)
    assert float(m["ce_excluded"]) == 1
    np.testing.assert_allclose(m["accept_rate"], [0.5, 0.5], rtol=1e-6)  # c* = 1 − ½·1

    # Random reduced vocab against the scatter-based numpy reference.
    rng = np.random.default_rng(1)
    v, n = 7, 4
    d2t = rng.permutation(v)[:n]
    draft = rng.normal(size=(3, 3, n))
    target = rng.normal(size=(3, 3, v))
    # Labels are target ids: the draft argmax's (through d2t) for most slots.
    labels = np.where(rng.random((3, 3)) < 0.7, d2t[draft.argmax(-1)], rng.integers(0, v, size=(3, 3)))
    mask = np.ones((3, 3), bool)
    conf = rng.normal(size=(3, 3))
    cfg = make_cfg()
    _, (_, m) = run_losses(draft, target, labels, mask, conf, cfg, d2t)
    ref = np_reference(draft, target, labels, mask, conf, cfg, d2t)
    assert ref["tau_greedy"] > 1.5
    for key in ("ce", "tv", "conf", "loss", "tau_probabilistic", "tau_greedy", "greedy_conditional_accept"):
        np.testing.assert_allclose(m[key], ref[key], rtol=2e-5, err_msg=key)
    assert float(m["ce_excluded"]) == ref["excluded"] > 0


def test_target_lse_path_equals_full_target_logits():
    """Target logits over the draft vocab + the full logsumexp give the full-logit losses."""
    rng = np.random.default_rng(3)
    v, n = 9, 5
    for d2t in (rng.permutation(v)[:n], None):
        width = v if d2t is None else n
        draft = jnp.asarray(rng.normal(size=(2, 3, width)), jnp.float32)
        target = jnp.asarray(rng.normal(size=(2, 3, v)) * 2, jnp.float32)
        labels = jnp.asarray(rng.integers(0, v, size=(2, 3)))
        mask = jnp.asarray(rng.random((2, 3)) < 0.8)
        conf = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
        cfg = make_cfg(vocab_size=v)
        d2t_j = None if d2t is None else jnp.asarray(d2t)
        full = block_losses(draft, target, labels, mask, conf, cfg, d2t_j)
        in_vocab = target if d2t is None else target[..., d2t]
        lse = jax.nn.logsumexp(target, axis=-1)
        restricted = block_losses(draft, in_vocab, labels, mask, conf, cfg, d2t_j, lse)
        for key in full:
            np.testing.assert_allclose(restricted[key], full[key], rtol=1e-5, atol=1e-6, err_msg=key)
        # A wrong lse (the draft-vocab-only normaliser) changes the TV term: the test has power.
        wrong = block_losses(draft, in_vocab, labels, mask, conf, cfg, d2t_j, jax.nn.logsumexp(in_vocab, -1))
        if d2t is not None:
            assert abs(float(wrong["tv_num"]) - float(full["tv_num"])) > 1e-3


def test_reduced_vocab_needs_d2t():
    with pytest.raises(ValueError, match="d2t_N"):
        run_losses(np.zeros((1, 2, 2)), np.zeros((1, 2, 4)), np.zeros((1, 2), int),
                   np.ones((1, 2), bool), None, make_cfg())


def test_no_confidence_head():
    draft, target, labels, mask, _ = hand_inputs()
    parts, (loss, m) = run_losses(draft, target, labels, mask, None, make_cfg())
    assert float(parts["conf_den"]) == 0 and float(m["conf"]) == 0
    np.testing.assert_allclose(loss, 0.1 * m["ce"] + 0.9 * m["tv"], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


def test_soft_label_is_detached():
    rng = np.random.default_rng(2)
    draft = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, size=(2, 3)))
    mask = jnp.ones((2, 3), bool)
    conf = jnp.asarray(rng.normal(size=(2, 3)) + 1.0, jnp.float32)  # z ≠ 0: ∂BCE/∂c* = −z ≠ 0
    conf_only = make_cfg(ce_weight=0.0, tv_weight=0.0, confidence_weight=1.0)

    def loss_fn(d, z):
        return combine(block_losses(d, target, labels, mask, z, conf_only), conf_only)[0]

    g_draft, g_conf = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(draft, conf)
    np.testing.assert_array_equal(g_draft, np.zeros_like(g_draft))
    assert float(jnp.abs(g_conf).min()) > 1e-4
    # And the draft logits DO get gradient from the other terms (the check above is meaningful).
    full = make_cfg()
    g_full = jax.jit(jax.grad(lambda d: combine(block_losses(d, target, labels, mask, conf, full), full)[0]))(draft)
    assert float(jnp.abs(g_full).max()) > 1e-3


def test_fully_masked_blocks_give_zero_not_nan():
    rng = np.random.default_rng(3)
    draft = jnp.asarray(rng.normal(size=(2, 3, 4)) * 30, jnp.float32)
    target = jnp.asarray(rng.normal(size=(2, 3, 6)) * 30, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 6, size=(2, 3)))
    mask = jnp.zeros((2, 3), bool)
    conf = jnp.asarray(rng.normal(size=(2, 3)) * 30, jnp.float32)
    d2t = jnp.asarray([5, 1, 0, 3])
    cfg = make_cfg()

    def loss_fn(d, z):
        loss, metrics = combine(block_losses(d, target, labels, mask, z, cfg, d2t), cfg)
        return loss, metrics

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))(draft, conf)
    assert float(loss) == 0.0
    for key, value in metrics.items():
        assert np.all(np.isfinite(value)), key
        np.testing.assert_array_equal(value, np.zeros_like(value), err_msg=key)
    for g in grads:
        assert np.all(np.isfinite(g))
        np.testing.assert_array_equal(g, np.zeros_like(g))


# ---------------------------------------------------------------------------------------------
# Chunking
# ---------------------------------------------------------------------------------------------


def _chunk_problem(chunk):
    """A toy drafter: block hiddens [B, A, G, D] → LM heads; params (w_draft, w_conf)."""
    rng = np.random.default_rng(4)
    b, a, g, d, v = 2, 8, 3, 4, 53  # V large enough that one chunk of logits outweighs the inputs
    h = jnp.asarray(rng.normal(size=(b, a, g, d)), jnp.float32)
    w_target = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, v, size=(b, a, g)))
    mask = supervision_mask(jnp.asarray(rng.random((b, a, g)) < 0.85))
    params = (
        jnp.asarray(rng.normal(size=(d, v)), jnp.float32),
        jnp.asarray(rng.normal(size=(d,)), jnp.float32),
    )
    cfg = make_cfg()

    def compute(params, start, size):
        w_draft, w_conf = params
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)  # noqa: E731
        hh = sl(h)
        return hh @ w_draft, hh @ w_target, sl(labels), sl(mask), hh @ w_conf, None

    def chunked(params):
        parts = chunked_block_losses(lambda s: compute(params, s, chunk), a, chunk, cfg)
        return combine(parts, cfg)

    def unchunked(params):
        return combine(block_losses(*compute(params, 0, a)[:5], cfg), cfg)

    return params, chunked, unchunked, (b, a, g, v)


def test_chunked_equals_unchunked():
    params, chunked, unchunked, _ = _chunk_problem(chunk=2)
    (l_c, m_c), g_c = jax.jit(jax.value_and_grad(chunked, has_aux=True))(params)
    (l_u, m_u), g_u = jax.jit(jax.value_and_grad(unchunked, has_aux=True))(params)
    np.testing.assert_allclose(l_c, l_u, rtol=1e-5)
    for key in m_u:
        np.testing.assert_allclose(m_c[key], m_u[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for gc, gu in zip(g_c, g_u):
        assert float(jnp.abs(gu).max()) > 0
        np.testing.assert_allclose(gc, gu, rtol=1e-4, atol=1e-6)


def test_chunked_backward_saves_no_logits():
    chunk = 2
    params, chunked, unchunked, (b, a, g, v) = _chunk_problem(chunk)
    chunk_logits = b * chunk * g * v

    def biggest(fn):
        # The function jax.vjp returns is a pytree whose leaves are the residuals it saved.
        residuals = jax.tree.leaves(jax.eval_shape(lambda p: jax.vjp(lambda q: fn(q)[0], p)[1], params))
        return max(int(np.prod(r.shape)) for r in residuals)

    assert chunk_logits > b * a * g * 4 and chunk_logits > 4 * v  # bigger than every input
    # Without chunking the backward keeps [B, A, G, V]-sized tensors; chunked, only the inputs.
    assert biggest(unchunked) >= b * a * g * v
    assert biggest(chunked) < chunk_logits


def test_chunked_rejects_partial_chunk():
    with pytest.raises(ValueError, match="multiple"):
        chunked_block_losses(lambda s: None, 7, 2, make_cfg())


# ---------------------------------------------------------------------------------------------
# Analytic τ and acceptance
# ---------------------------------------------------------------------------------------------


def test_expected_tau_hand_cases():
    np.testing.assert_allclose(expected_tau(jnp.array([1.0, 1.0, 1.0])), 4.0)
    np.testing.assert_allclose(expected_tau(jnp.array([0.5, 0.5])), 1 + 0.5 + 0.25)
    np.testing.assert_allclose(expected_tau(jnp.array([0.0, 1.0, 1.0])), 1.0)
    np.testing.assert_allclose(expected_tau(jnp.array([0.8, 0.5, 1.0])), 1 + 0.8 + 0.4 + 0.4, rtol=1e-6)
    np.testing.assert_allclose(expected_tau_from_tv(jnp.array([0.0, 0.0, 0.0])), 4.0)
    np.testing.assert_allclose(expected_tau_from_tv(jnp.array([0.5, 0.5])), 1.75)
    np.testing.assert_allclose(expected_tau_from_tv(jnp.array([0.2, 0.5])), 1 + 0.8 + 0.4, rtol=1e-6)


def test_expected_tau_mean_over_valid_blocks():
    a = jnp.array([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(expected_tau(a), [4.0, 1.75, 1.0])
    np.testing.assert_allclose(expected_tau(a, valid=jnp.array([True, True, False])), (4.0 + 1.75) / 2)
    np.testing.assert_allclose(expected_tau(a, valid=jnp.array([False, False, True])), 1.0)
    assert float(expected_tau(a, valid=jnp.zeros(3, bool))) == 0.0
    np.testing.assert_allclose(expected_tau_from_tv(1.0 - a, valid=jnp.array([1, 0, 1])), 2.5)


def test_acceptance_probability_is_one_minus_tv():
    rng = np.random.default_rng(5)
    p_d = np_softmax(rng.normal(size=(6, 9)) * 2)
    p_t = np_softmax(rng.normal(size=(6, 9)) * 2)
    acc = acceptance_probability(jnp.asarray(p_d), jnp.asarray(p_t))
    np.testing.assert_allclose(acc, 1 - 0.5 * np.abs(p_d - p_t).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(acc, 1 - total_variation(jnp.asarray(p_d), jnp.asarray(p_t)), rtol=1e-5)
    # Hand case: min([.5,.5,0],[.25,.25,.5]) sums to .5; TV = ½(.25+.25+.5) = .5.
    np.testing.assert_allclose(acceptance_probability(jnp.array([0.5, 0.5, 0.0]), jnp.array([0.25, 0.25, 0.5])), 0.5)


def test_per_position_acceptance_and_width_histogram():
    from dspark_jax.eval.metrics import per_position_acceptance, width_histogram

    # rounds: (accepted, offered) = (3, 3), (1, 3), (0, 2), (2, 2), (0, 0)
    got = per_position_acceptance(np.array([3, 1, 0, 2, 0]), np.array([3, 3, 2, 2, 0]), 4)
    # k=1: tried 4 (not the ℓ=0 round), kept 3; k=2: tried by rounds 1,2,4 -> kept 2;
    # k=3: tried by round 1 only (round 2 stopped at 1, round 4 offered 2) -> kept 1; k=4: never.
    np.testing.assert_allclose(got[:3], [3 / 4, 2 / 3, 1.0])
    assert np.isnan(got[3])
    assert width_histogram([4, 8, 4, 1]) == {1: 1, 4: 2, 8: 1}
