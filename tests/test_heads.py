"""Markov heads, confidence head and left-to-right block sampling (spec §2–§3)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, SamplingConfig
from dspark_jax.drafter.heads import (
    INIT_STD,
    ConfidenceHead,
    MarkovHead,
    make_confidence_head,
    make_markov_head,
    sample_block,
)
from dspark_jax.sampling import SamplingParams, probabilities
from tests.tiny import tiny_config

V, D, R, GAMMA = 50, 16, 8, 5
KINDS = ("vanilla", "gated", "rnn")


def drafter_config(**kw) -> DrafterConfig:
    target = tiny_config(vocab_size=V, hidden_size=D, intermediate_size=32, num_heads=2,
                         num_kv_heads=1, head_dim=8)
    kw = {"markov_rank": R, "block_size": GAMMA, **kw}
    return DrafterConfig.for_target(target, num_layers=1, tap_layers=(0,), mask_token_id=3, **kw)


def randomize(module: nnx.Module, seed: int, std: float = 0.6) -> nnx.Module:
    """Replace every parameter (biases included) by N(0, std²) so each term visibly matters."""
    params = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [jax.random.normal(k, x.shape, x.dtype) * std for k, x in zip(keys, leaves)]
    nnx.update(module, jax.tree.unflatten(treedef, new))
    return module


def markov(kind: str, seed: int = 0, **kw) -> MarkovHead:
    return randomize(MarkovHead(drafter_config(markov_head=kind, **kw), rngs=nnx.Rngs(seed)), seed + 100)


def inputs(seed: int, lead=(2, 3), gamma=GAMMA):
    kh, kp = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kh, (*lead, gamma, D)),
            jax.random.randint(kp, (*lead, gamma), 0, V, dtype=jnp.int32))


def np_params(head: MarkovHead):
    get = lambda p: np.asarray(p[...], np.float64)  # noqa: E731
    out = {"w1": get(head.w1), "w2": get(head.w2.weight)}
    if head.joint is not None:
        out["J"], out["bJ"] = get(head.joint.weight), get(head.joint.bias)
    if head.gate is not None:
        out["Wg"], out["bg"] = get(head.gate.weight), get(head.gate.bias)
    return out


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rnn_reference(p, h_GxD, prev_G, bias_from_new_state=False):
    """Spec §2.3 in plain numpy, one block: returns [G, N]."""
    s = np.zeros(R)
    out = []
    for k in range(len(prev_G)):
        z = np.concatenate([s, p["w1"][prev_G[k]], h_GxD[k]])
        g_raw, c_raw, o_raw = np.split(p["J"] @ z + p["bJ"], 3)
        s = sigmoid(g_raw) * s + (1 - sigmoid(g_raw)) * np.tanh(c_raw)
        out.append(p["w2"] @ (np.tanh(s) if bias_from_new_state else np.tanh(o_raw)))
    return np.stack(out)


# ----------------------------------------------------------------------------- construction


def test_factory_shapes_and_hf_init():
    assert make_markov_head(drafter_config(markov_head="none", confidence_with_markov=False),
                            nnx.Rngs(0)) is None
    with pytest.raises(ValueError, match="none"):
        MarkovHead(drafter_config(markov_head="none", confidence_with_markov=False), rngs=nnx.Rngs(0))
    for kind in KINDS:
        head = make_markov_head(drafter_config(markov_head=kind, draft_vocab_size=20), nnx.Rngs(0))
        assert head.w1[...].shape == (V, R)  # previous tokens are target ids
        assert head.w2.weight[...].shape == (20, R)  # bias lives in the draft vocab
        assert (head.gate is not None) == (kind == "gated")
        assert (head.joint is not None) == (kind == "rnn")
        if kind == "gated":
            assert head.gate.weight[...].shape == (R, D + R)
        if kind == "rnn":
            assert head.joint.weight[...].shape == (3 * R, 2 * R + D)
        for path, leaf in jax.tree.leaves_with_path(nnx.state(head, nnx.Param)):
            name = jax.tree_util.keystr(path)
            if "bias" in name:
                assert np.all(np.asarray(leaf) == 0), name
            else:
                assert abs(float(jnp.std(leaf)) - INIT_STD) < 0.1 * INIT_STD, name
                assert abs(float(jnp.mean(leaf))) < 0.2 * INIT_STD, name


# ----------------------------------------------------------------------------- Markov heads


@pytest.mark.parametrize("kind", KINDS)
def test_block_bias_equals_step_loop(kind):
    head = markov(kind, draft_vocab_size=20)
    h, prev = inputs(1)
    block = head.block_bias(h, prev)
    assert block.shape == (2, 3, GAMMA, 20)
    state = head.init_state((2, 3))
    assert state.shape == (2, 3, R)
    steps = []
    for s in range(GAMMA):
        bias, state = head.step(state, head.slot_inputs(h[..., s, :]), prev[..., s])
        steps.append(bias)
    np.testing.assert_allclose(np.asarray(block), np.stack(steps, axis=-2), rtol=1e-5, atol=1e-6)
    assert float(jnp.std(block)) > 0.1  # not trivially zero


@pytest.mark.parametrize("kind", ("vanilla", "gated"))
def test_vanilla_and_gated_match_numpy(kind):
    head = markov(kind)
    p = np_params(head)
    h, prev = inputs(2)
    e = p["w1"][np.asarray(prev)]
    if kind == "gated":
        e = sigmoid(np.concatenate([np.asarray(h, np.float64), e], -1) @ p["Wg"].T + p["bg"]) * e
    np.testing.assert_allclose(np.asarray(head.block_bias(h, prev)), e @ p["w2"].T, rtol=1e-4, atol=1e-5)


def test_rnn_matches_numpy_reference_and_not_new_state_variant():
    head = markov("rnn")
    p = np_params(head)
    h, prev = inputs(3, lead=(4,))
    got = np.asarray(head.block_bias(h, prev))
    h64, prev_np = np.asarray(h, np.float64), np.asarray(prev)
    ref = np.stack([rnn_reference(p, h64[b], prev_np[b]) for b in range(4)])
    wrong = np.stack([rnn_reference(p, h64[b], prev_np[b], bias_from_new_state=True) for b in range(4)])
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    # The two readings of Eq. 6 are far apart here, so the comparison above discriminates.
    assert np.max(np.abs(got - wrong)) > 0.1


def test_rnn_bias_reads_output_chunk_not_state():
    """Perturbing only the gate/candidate rows of J leaves slot 0's bias unchanged (s_0 = 0 and
    B_0 depends on o only) but changes later slots through the carried state; perturbing only the
    output rows changes slot 0. A bias built from s_k would behave the other way round."""
    head = markov("rnn")
    h, prev = inputs(4, lead=(3,))
    base = np.asarray(head.block_bias(h, prev))
    joint_w = head.joint.weight[...]
    for rows, slot0_changes in ((slice(0, 2 * R), False), (slice(2 * R, 3 * R), True)):
        head.joint.weight[...] = joint_w.at[rows].add(0.5)
        moved = np.abs(np.asarray(head.block_bias(h, prev)) - base)
        head.joint.weight[...] = joint_w
        assert (moved[:, 0].max() > 1e-2) == slot0_changes
        assert moved[:, 1:].max() > 1e-2
        if not slot0_changes:
            assert moved[:, 0].max() == 0.0


def test_rnn_state_is_carried_in_block_bias():
    """Slot 1's bias depends on slot 0's token (through s_1) for the RNN, not for vanilla."""
    for kind, depends in (("rnn", True), ("vanilla", False), ("gated", False)):
        head = markov(kind)
        h, prev = inputs(5, lead=(2,))
        other = prev.at[:, 0].set((prev[:, 0] + 1) % V)
        delta = np.abs(np.asarray(head.block_bias(h, prev) - head.block_bias(h, other)))
        assert delta[:, 0].max() > 1e-2
        assert (delta[:, 1:].max() > 1e-3) == depends, kind


# ----------------------------------------------------------------------------- sampling


def block_inputs(seed: int, batch: int, n_draft: int, gamma=GAMMA, scale=2.0):
    kl, kh, ka, kk = jax.random.split(jax.random.key(seed), 4)
    base = jax.random.normal(kl, (batch, gamma, n_draft)) * scale
    h = jax.random.normal(kh, (batch, gamma, D))
    anchor = jax.random.randint(ka, (batch,), 0, V, dtype=jnp.int32)
    keys = jax.random.key_data(jax.random.split(kk, batch * gamma)).reshape(batch, gamma, -1)
    return base, h, anchor, keys


def d2t_for(n_draft: int) -> jnp.ndarray:
    return jnp.asarray(np.sort(np.random.default_rng(7).choice(V, n_draft, replace=False)), jnp.int32)


@pytest.mark.parametrize("kind,n_draft", [("vanilla", None), ("gated", 20), ("rnn", 20), ("none", None)])
def test_greedy_sample_block_is_stepwise_argmax(kind, n_draft):
    n = n_draft or V
    head = None if kind == "none" else markov(kind, draft_vocab_size=n_draft)
    base, h, anchor, keys = block_inputs(6, 4, n)
    d2t = None if n_draft is None else d2t_for(n)
    params = SamplingParams.broadcast(SamplingConfig(), 4)
    run = nnx.jit(sample_block, static_argnames=("vocab_size",))
    out = run(head, base, h, anchor, params, keys, d2t, vocab_size=V)
    eager = sample_block(head, base, h, anchor, params, keys, d2t, vocab_size=V)
    np.testing.assert_array_equal(out.tokens_BxG, eager.tokens_BxG)

    tokens, prev = np.asarray(out.tokens_BxG), np.asarray(out.prev_tokens_BxG)
    np.testing.assert_array_equal(prev[:, 0], anchor)
    np.testing.assert_array_equal(prev[:, 1:], tokens[:, :-1])
    bias = 0.0 if head is None else np.asarray(head.block_bias(h, out.prev_tokens_BxG))
    expected_logits = np.asarray(base) + bias
    np.testing.assert_allclose(out.corrected_logits_BxGxN, expected_logits, rtol=1e-5, atol=1e-5)
    idx = np.argmax(expected_logits, axis=-1)
    expected_tokens = idx if d2t is None else np.asarray(d2t)[idx]
    np.testing.assert_array_equal(tokens, expected_tokens)
    q = np.asarray(out.q_BxGxV)
    assert q.shape == (4, GAMMA, V)
    np.testing.assert_array_equal(q, np.eye(V)[tokens])  # greedy: q is one-hot at the token
    if head is not None:  # the bias actually steers the chain away from argmax(U)
        plain = np.argmax(np.asarray(base), -1)
        assert np.any(plain != idx)


def reference_q(out, params, d2t):
    logits = out.corrected_logits_BxGxN
    b, g, n = logits.shape
    q = np.asarray(probabilities(logits.reshape(b * g, n), params.expand(g))).reshape(b, g, n)
    if d2t is None:
        return q
    full = np.zeros((b, g, V), np.float32)
    full[..., np.asarray(d2t)] = q
    return full


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_draft", [None, 20])
def test_q_is_sampling_distribution(kind, n_draft):
    n = n_draft or V
    head = markov(kind, draft_vocab_size=n_draft)
    configs = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4),
               SamplingConfig(temperature=1.3, top_p=0.6), SamplingConfig(),
               SamplingConfig(temperature=0.9, top_k=6, top_p=0.8), SamplingConfig(temperature=1.0)]
    params = SamplingParams.from_configs(configs)
    base, h, anchor, keys = block_inputs(8, len(configs), n)
    d2t = None if n_draft is None else d2t_for(n)
    out = sample_block(head, base, h, anchor, params, keys, d2t, vocab_size=V)
    q, tokens = np.asarray(out.q_BxGxV), np.asarray(out.tokens_BxG)

    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(q, reference_q(out, params, d2t), atol=1e-6)
    assert np.all(np.take_along_axis(q, tokens[..., None], -1) > 0)
    if d2t is not None:
        outside = np.setdiff1d(np.arange(V), np.asarray(d2t))
        assert np.all(q[..., outside] == 0.0)
        assert np.all(np.isin(tokens, np.asarray(d2t)))
    # Support restrictions, read off the corrected logits in the draft vocabulary.
    q_draft = q if d2t is None else q[..., np.asarray(d2t)]
    logits = np.asarray(out.corrected_logits_BxGxN, np.float64)
    for row, c in enumerate(configs):
        for s in range(GAMMA):
            support = q_draft[row, s] > 0
            x = logits[row, s]
            if c.greedy:
                assert support.sum() == 1
                continue
            # The support is a top set of the logits ...
            if not support.all():
                assert x[support].min() >= x[~support].max()
            if c.top_k:
                assert support.sum() <= c.top_k
            if c.top_p < 1.0:  # ... and the smallest one reaching top_p (after top-k)
                kept = np.sort(x)[::-1][: c.top_k or n] / c.temperature
                p = np.exp(kept - kept.max())
                p /= p.sum()
                m = int(support.sum())
                assert p[:m].sum() >= c.top_p - 1e-6
                assert p[: m - 1].sum() < c.top_p + 1e-6
            if not c.top_k and c.top_p == 1.0:
                assert support.all()


def chi2_critical(df: int, z: float = 4.265) -> float:
    """Upper chi-square quantile at p ≈ 1e-5 (Wilson–Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("kind", ("vanilla", "rnn"))
def test_first_two_tokens_follow_q(kind):
    """Many independent keys on one block: the joint frequency of (x_1, x_2) matches
    q_1(x_1) · q_2(x_2 | x_1), where q_2 is the q row returned next to each sample."""
    n_draft, rows = 6, 20000
    head = markov(kind, draft_vocab_size=n_draft)
    d2t = d2t_for(n_draft)
    base, h, anchor, _ = block_inputs(9, 1, n_draft, scale=1.0)
    base, h = jnp.repeat(base, rows, 0), jnp.repeat(h, rows, 0)
    anchor = jnp.repeat(anchor, rows, 0)
    keys = jax.random.key_data(jax.random.split(jax.random.key(10), rows * GAMMA)).reshape(rows, GAMMA, -1)
    params = SamplingParams.broadcast(SamplingConfig(temperature=0.9, top_k=5), rows)
    out = jax.jit(lambda *a: sample_block(head, *a))(base, h, anchor, params, keys, d2t)
    lookup = {int(t): i for i, t in enumerate(np.asarray(d2t))}
    x1 = np.vectorize(lookup.get)(np.asarray(out.tokens_BxG[:, 0]))
    x2 = np.vectorize(lookup.get)(np.asarray(out.tokens_BxG[:, 1]))
    q = np.asarray(out.q_BxGxV)[..., np.asarray(d2t)].astype(np.float64)
    q1 = q[0, 0]
    np.testing.assert_array_equal(q[:, 0], np.broadcast_to(q1, q[:, 0].shape))
    expected = np.zeros((n_draft, n_draft))
    for a in range(n_draft):
        rows_a = np.flatnonzero(x1 == a)
        if rows_a.size:
            q2 = q[rows_a[0], 1]
            np.testing.assert_array_equal(q[rows_a, 1], np.broadcast_to(q2, (rows_a.size, n_draft)))
            expected[a] = q1[a] * q2
        else:
            assert q1[a] * rows < 1.0, "a likely first token never appeared"
    expected *= rows
    observed = np.zeros_like(expected)
    np.add.at(observed, (x1, x2), 1)
    assert np.all(observed[expected == 0] == 0)  # nothing sampled outside the support
    cells = expected > 0
    assert np.abs(expected.sum() - rows) < 1e-6 * rows + 1.0
    big = cells & (expected >= 5)
    small = cells & ~big  # pool sparse cells into one
    obs = np.append(observed[big], observed[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    df = int(keep.sum()) - 1
    assert df >= 10
    assert stat < chi2_critical(df), (stat, df)
    # The Markov bias makes q_2 depend on x_1 here, so the test sees the chain's conditioning.
    q2_rows = {tuple(np.round(q[np.flatnonzero(x1 == a)[0], 1], 6)) for a in np.unique(x1)}
    assert len(q2_rows) > 1


# ----------------------------------------------------------------------------- confidence head


@pytest.mark.parametrize("with_markov", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_confidence_head_formula_and_switches(with_markov, bias):
    cfg = drafter_config(confidence_with_markov=with_markov, confidence_bias=bias)
    conf = make_confidence_head(cfg, nnx.Rngs(0))
    assert conf is not None
    assert (conf.proj.bias is None) == (not bias)
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(nnx.state(conf, nnx.Param))}
    assert any("bias" in n for n in names) == bias
    assert conf.proj.weight[...].shape == (1, D + (R if with_markov else 0))
    randomize(conf, 1)
    head = markov("vanilla")
    h, prev = inputs(11)
    z = conf(h, prev, head)
    assert z.shape == (2, 3, GAMMA) and z.dtype == jnp.float32
    feats = np.asarray(h, np.float64)
    if with_markov:
        feats = np.concatenate([feats, np.asarray(head.w1[...], np.float64)[np.asarray(prev)]], -1)
    ref = feats @ np.asarray(conf.proj.weight[...], np.float64)[0]
    if bias:
        ref = ref + float(conf.proj.bias[...][0])
    np.testing.assert_allclose(np.asarray(z), ref, rtol=1e-4, atol=1e-5)
    other = (prev + 1) % V
    changed = np.abs(np.asarray(conf(h, other, head) - z)).max()
    assert (changed > 1e-3) == with_markov
    if not with_markov:
        np.testing.assert_array_equal(conf(h, None, None), z)
    else:
        with pytest.raises(ValueError):
            conf(h, prev, None)


def test_confidence_reads_h_k_and_x_prev_not_x_k():
    """Through a sampled block: c_k depends on h_k and x_{k-1} (prev_tokens), never on x_k."""
    conf = randomize(ConfidenceHead(drafter_config(), rngs=nnx.Rngs(0)), 2)
    head = markov("rnn")
    base, h, anchor, keys = block_inputs(12, 3, V)
    params = SamplingParams.broadcast(SamplingConfig(temperature=1.0), 3)
    out = sample_block(head, base, h, anchor, params, keys)
    prev_of = lambda toks: jnp.concatenate([anchor[:, None], toks[:, :-1]], 1)  # noqa: E731
    np.testing.assert_array_equal(prev_of(out.tokens_BxG), out.prev_tokens_BxG)
    z = np.asarray(conf(h, out.prev_tokens_BxG, head))
    s = 2
    tokens = out.tokens_BxG.at[:, s].set((out.tokens_BxG[:, s] + 1) % V)  # change x_k of slot s
    z_tok = np.asarray(conf(h, prev_of(tokens), head))
    np.testing.assert_array_equal(z_tok[:, : s + 1], z[:, : s + 1])  # slots <= s unchanged
    assert np.abs(z_tok[:, s + 1] - z[:, s + 1]).min() > 1e-4  # slot s+1 sees it as x_{k-1}
    assert np.all(z_tok[:, s + 2:] == z[:, s + 2:])
    z_h = np.asarray(conf(h.at[:, s].add(1.0), out.prev_tokens_BxG, head))
    assert np.abs(z_h[:, s] - z[:, s]).min() > 1e-4
    np.testing.assert_array_equal(np.delete(z_h, s, 1), np.delete(z, s, 1))


# ----------------------------------------------------------------------------- gradients


class Heads(nnx.Module):
    def __init__(self, cfg):
        self.markov = MarkovHead(cfg, rngs=nnx.Rngs(0))
        self.conf = ConfidenceHead(cfg, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind):
    heads = Heads(drafter_config(markov_head=kind, draft_vocab_size=20))  # HF init, as trained
    h, prev = inputs(13)
    w_bias = jax.random.normal(jax.random.key(14), (2, 3, GAMMA, 20))
    w_conf = jax.random.normal(jax.random.key(15), (2, 3, GAMMA))

    def loss(m):
        bias = m.markov.block_bias(h, prev)
        z = m.conf(h, prev, m.markov)
        return jnp.sum(jnp.tanh(bias) * w_bias) + jnp.sum(jax.nn.log_sigmoid(z) * w_conf)

    grads = nnx.grad(loss)(heads)
    leaves = jax.tree.leaves_with_path(grads)
    names = {jax.tree_util.keystr(p) for p, _ in leaves}
    expected = {"w1", "w2", "conf"} | ({"gate"} if kind == "gated" else set()) | (
        {"joint"} if kind == "rnn" else set())
    assert all(any(e in n for n in names) for e in expected), names
    assert len(leaves) == {"vanilla": 4, "gated": 6, "rnn": 6}[kind]
    for path, g in leaves:
        assert np.any(np.asarray(g) != 0), jax.tree_util.keystr(path)
