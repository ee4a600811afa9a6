"""DSpark's sequential stage: the Markov heads, the confidence head and block sampling (spec §2–§3).

Shapes and vocabularies:

* ``V`` is the target vocabulary, ``N`` the drafter's logit vocabulary (``draft_vocab_size`` or V).
  Previous tokens are always TARGET ids, so ``W1`` is ``[V, r]``; the bias lives in the draft
  logit space, so ``W2`` is ``r -> N``. With a reduced vocabulary, draft index ``i`` is target id
  ``d2t[i]`` (``d2t``: int32 ``[N]``, absolute ids, distinct). ``markov_w1_rows="draft"`` gives
  ``W1`` a row per draft token (in ``d2t`` order) plus a last row shared by every other target id:
  ``[N+1, r]``. Every token the head drafts has its own row; only anchors outside the draft
  vocabulary share one.
* Parameter layouts follow DeepSpec/HF (``[out, in]``): ``markov_w1 [V, r]``, ``markov_w2 [N, r]``,
  ``gate_proj [r, d+r] + [r]``, ``joint_proj [3r, 2r+d] + [3r]``, ``confidence proj [1, d(+r)] (+ [1])``.
  Initialisation is HF's ``_init_weights``: weights ~ N(0, 0.02), biases 0 (spec §1.1).

The three Markov heads share one recurrence interface: ``_features(state, hx, prev)`` returns the
r-wide vector that ``W2`` maps to the bias, plus the next state (vanilla and gated pass the state
through untouched). ``hx`` is :meth:`MarkovHead.slot_inputs`: the ``h_k`` half of the gate's or
``J``'s pre-activation, computed for every slot before the chain is drawn, because only the
``W1[x_{k-1}]`` (and state) half depends on the drawn tokens; the sequential loop then multiplies
``r`` columns instead of ``d + r`` (gated) or ``2r + d`` (RNN). Training uses
:meth:`MarkovHead.block_bias` (teacher forcing), sampling uses :meth:`MarkovHead.step` inside
:func:`sample_block`; both run the same ``slot_inputs`` and ``_features``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.models.layers import Linear, project
from dspark_jax.sampling import SamplingParams, probabilities, sample

INIT_STD = 0.02  # HF initializer_range (Qwen3, Llama)


def _normal(rngs: nnx.Rngs, shape, dtype) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape) * INIT_STD).astype(dtype)


class LinearWithBias(nnx.Module):
    """``x @ weight.T (+ bias)`` with ``[out, in]`` weights; HF init (N(0, 0.02), bias 0).

    ``bias=False`` leaves ``self.bias`` as ``None`` (no parameter at all), which is how a
    bias-less confidence head is told apart from one whose bias happens to be zero.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = project(x, self.weight[...])
        return y if self.bias is None else y + self.bias[...]


class MarkovHead(nnx.Module):
    """Vanilla, gated or RNN Markov head (``cfg.markov_head``), spec §2.1–§2.3.

    * vanilla: ``B = W2 W1[x_{k-1}]``
    * gated:   ``B = W2 (σ(W_g [h_k ; W1[x_{k-1}]] + b_g) ⊙ W1[x_{k-1}])``
    * rnn:     ``[g, c, o] = J [s_{k-1} ; W1[x_{k-1}] ; h_k] + b_J``;
      ``s_k = σ(g) ⊙ s_{k-1} + (1-σ(g)) ⊙ tanh(c)``; ``B_k = W2 tanh(o)`` — the bias comes from
      ``o`` of the same pre-activation, NOT from the new state ``s_k``; ``s_0 = 0``.
    """

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, draft_vocab: nnx.Variable | None = None):
        if cfg.markov_head == "none":
            raise ValueError("markov_head='none' has no Markov head; use make_markov_head(cfg, rngs)")
        self.kind = cfg.markov_head
        self.rank = r = cfg.markov_rank
        self.vocab_size = cfg.vocab_size
        self.draft_vocab_size = cfg.draft_vocab_size or cfg.vocab_size
        d = cfg.hidden_size
        # With draft rows, W1 is indexed through the reduced head's d2t (the same variable, shared).
        self.d2t = draft_vocab if cfg.markov_w1_rows == "draft" else None
        if cfg.markov_w1_rows == "draft" and draft_vocab is None:
            raise ValueError("markov_w1_rows='draft' needs the reduced head's draft vocabulary")
        rows = cfg.vocab_size if self.d2t is None else self.draft_vocab_size + 1
        self.w1 = nnx.Param(_normal(rngs, (rows, r), dtype))
        self.w2 = Linear(r, self.draft_vocab_size, rngs=rngs, dtype=dtype, init_std=INIT_STD)
        self.gate = LinearWithBias(d + r, r, rngs=rngs, dtype=dtype) if self.kind == "gated" else None
        self.joint = LinearWithBias(2 * r + d, 3 * r, rngs=rngs, dtype=dtype) if self.kind == "rnn" else None

    def w1_rows(self, prev_tokens: jax.Array) -> jax.Array:
        """The ``W1`` row of each target id: the id itself, or with draft rows its draft index
        (``d2t`` is ascending, so a binary search) and ``N`` for ids outside the draft vocabulary."""
        if self.d2t is None:
            return prev_tokens
        d2t = self.d2t[...]
        index = jnp.minimum(jnp.searchsorted(d2t, prev_tokens), d2t.shape[0] - 1)
        return jnp.where(d2t[index] == prev_tokens, index, d2t.shape[0])

    def embed(self, prev_tokens: jax.Array) -> jax.Array:
        """``W1[x]`` for target ids of any shape: ``[...] -> [..., r]``."""
        return jnp.take(self.w1[...], self.w1_rows(prev_tokens), axis=0)

    def slot_inputs(self, h_xd: jax.Array | None) -> jax.Array | None:
        """The part of each step's pre-activation that ``h_k`` alone decides, bias included:
        ``W_g[:, :d] h + b_g`` (gated, ``[..., r]``) or ``J[:, 2r:] h + b_J`` (RNN, ``[..., 3r]``);
        ``None`` for vanilla, which does not read ``h``. Any leading shape (one slot or a block)."""
        if self.kind == "vanilla":
            return None
        proj = self.gate if self.kind == "gated" else self.joint
        weight = proj.weight[...]
        h_columns = weight[:, : h_xd.shape[-1]] if self.kind == "gated" else weight[:, 2 * self.rank :]
        return project(h_xd.astype(weight.dtype), h_columns) + proj.bias[...]

    def _features(self, state, hx, prev):
        """One step before ``W2`` from its slot inputs ``hx``: returns (``u [..., r]``, next state)."""
        e = self.embed(prev)
        if self.kind == "vanilla":
            return e, state
        if self.kind == "gated":
            g = jax.nn.sigmoid(hx + project(e, self.gate.weight[...][:, -self.rank :]))
            return g * e, state
        z = jnp.concatenate([state.astype(e.dtype), e], axis=-1)
        g_raw, c_raw, o_raw = jnp.split(hx + project(z, self.joint.weight[...][:, : 2 * self.rank]), 3, axis=-1)
        gate = jax.nn.sigmoid(g_raw)
        new_state = gate * state + (1.0 - gate) * jnp.tanh(c_raw)
        return jnp.tanh(o_raw), new_state.astype(state.dtype)

    def init_state(self, batch_shape) -> jax.Array:
        """``s_0 = 0`` of shape ``batch_shape + (r,)`` (carried unchanged by vanilla/gated)."""
        return jnp.zeros((*tuple(batch_shape), self.rank), self.w1[...].dtype)

    def step(self, state: jax.Array, hx_Bx: jax.Array | None, prev_B: jax.Array):
        """One sampling step from the slot's :meth:`slot_inputs`: ``(bias [..., N], next state)``."""
        u, new_state = self._features(state, hx_Bx, prev_B)
        return self.w2(u), new_state

    def block_bias(self, h_xGxd: jax.Array | None, prev_tokens_xG: jax.Array) -> jax.Array:
        """Teacher-forced bias for a whole block: ``[..., G, d], [..., G] -> [..., G, N]``.

        ``prev_tokens[..., 0]`` is the anchor, ``prev_tokens[..., s]`` the ground truth token
        ``s`` (target ids). The RNN is unrolled over G with its state carried; ``W2`` is applied
        once to all slots.
        """
        hx = self.slot_inputs(h_xGxd)
        if self.kind != "rnn":
            u, _ = self._features(None, hx, prev_tokens_xG)
            return self.w2(u)

        def body(state, xs):
            hx_s, prev_s = xs
            u, state = self._features(state, hx_s, prev_s)
            return state, u

        state0 = self.init_state(prev_tokens_xG.shape[:-1])
        xs = (jnp.moveaxis(hx, -2, 0), jnp.moveaxis(prev_tokens_xG, -1, 0))
        _, u_Gx = jax.lax.scan(body, state0, xs)
        return self.w2(jnp.moveaxis(u_Gx, 0, -2))


def make_markov_head(cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32,
                     draft_vocab: nnx.Variable | None = None) -> MarkovHead | None:
    """The configured Markov head, or ``None`` for ``markov_head='none'`` (DFlash)."""
    return None if cfg.markov_head == "none" else MarkovHead(cfg, rngs=rngs, dtype=dtype, draft_vocab=draft_vocab)


class ConfidenceHead(nnx.Module):
    """``z_k = w·[h_k ; W1[x_{k-1}]] + b`` (spec §3.1), returned as float32 logits.

    ``cfg.confidence_with_markov=False`` drops the ``W1`` feature (then ``prev_tokens`` and
    ``markov_head`` are ignored); ``cfg.confidence_bias=False`` drops ``b``. ``W1`` is the Markov
    head's table, looked up through the head passed in at call time (shared, never copied). The
    head never sees ``x_k``.
    """

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.with_markov = cfg.confidence_with_markov
        width = cfg.hidden_size + (cfg.markov_rank if self.with_markov else 0)
        self.proj = LinearWithBias(width, 1, bias=cfg.confidence_bias, rngs=rngs, dtype=dtype)

    def __call__(self, h_xd: jax.Array, prev_tokens_x: jax.Array | None = None,
                 markov_head: MarkovHead | None = None) -> jax.Array:
        features = h_xd.astype(jnp.float32)
        if self.with_markov:
            if markov_head is None or prev_tokens_x is None:
                raise ValueError("a confidence head with the Markov feature needs prev_tokens and the Markov head")
            e = markov_head.embed(prev_tokens_x).astype(jnp.float32)
            features = jnp.concatenate([features, e], axis=-1)
        weight = self.proj.weight[...].astype(jnp.float32)
        z = jnp.einsum("...k,nk->...n", features, weight)[..., 0]
        if self.proj.bias is not None:
            z = z + self.proj.bias[...].astype(jnp.float32)[0]
        return z


def make_confidence_head(cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32) -> ConfidenceHead | None:
    """The confidence head, or ``None`` when ``cfg.confidence_head`` is off."""
    return ConfidenceHead(cfg, rngs=rngs, dtype=dtype) if cfg.confidence_head else None


class DraftBlock(NamedTuple):
    tokens_BxG: jax.Array  # int32 target ids x_1..x_γ
    corrected_logits_BxGxN: jax.Array  # float32 U + B(prev), draft vocabulary
    q_BxGxV: jax.Array  # float32 distribution each token was drawn from, over the target vocab
    prev_tokens_BxG: jax.Array  # int32 [anchor, x_1..x_{γ-1}] (the confidence head's x_{k-1})


def scatter_to_target(p_xN: jax.Array, d2t_N: jax.Array | None, vocab_size: int) -> jax.Array:
    """Draft-vocabulary values ``[..., N]`` placed at their target ids ``[..., V]`` (0 elsewhere)."""
    if d2t_N is None:
        return p_xN
    out = jnp.zeros((*p_xN.shape[:-1], vocab_size), p_xN.dtype)
    return out.at[..., d2t_N].set(p_xN)


def sample_block(
    markov_head: MarkovHead | None,
    base_logits_BxGxN: jax.Array,
    h_BxGxd: jax.Array | None,
    anchor_B: jax.Array,
    params: SamplingParams,
    keys_BxG: jax.Array,
    d2t_N: jax.Array | None = None,
    vocab_size: int | None = None,
) -> DraftBlock:
    """Sample a chain of γ draft tokens left to right (spec §2.5), one ``lax.scan`` over slots.

    Slot ``s`` is drawn with :func:`dspark_jax.sampling.sample` from ``U_s + B(prev)`` with the
    row's temperature/top-k/top-p and key ``keys_BxG[:, s]``; ``prev`` is the anchor for slot 0,
    then the previous slot's sampled token as a TARGET id. ``q`` is
    :func:`dspark_jax.sampling.probabilities` of the same corrected logits, computed in the same
    step, scattered into the target vocabulary when ``d2t_N`` is given. With no Markov head
    (DFlash) the slots are independent draws from ``U``.
    """
    batch, gamma, n_draft = base_logits_BxGxN.shape
    if d2t_N is None:
        vocab_size = n_draft if vocab_size is None else vocab_size
        if vocab_size != n_draft:
            raise ValueError(f"logits cover {n_draft} tokens but vocab_size is {vocab_size}; pass d2t_N")
    else:
        if d2t_N.shape != (n_draft,):
            raise ValueError(f"d2t_N has shape {d2t_N.shape}; logits need ({n_draft},)")
        if vocab_size is None:
            if markov_head is None:
                raise ValueError("with d2t_N and no Markov head, pass vocab_size (the target V)")
            vocab_size = markov_head.vocab_size
        d2t_N = d2t_N.astype(jnp.int32)

    def body(carry, xs):
        prev_B, state = carry
        logits_BxN, hx_Bx, keys_B = xs
        logits_BxN = logits_BxN.astype(jnp.float32)
        if markov_head is not None:
            bias_BxN, state = markov_head.step(state, hx_Bx, prev_B)
            logits_BxN = logits_BxN + bias_BxN.astype(jnp.float32)
        idx_B = sample(logits_BxN, params, keys_B)
        q_BxN = probabilities(logits_BxN, params)
        token_B = idx_B if d2t_N is None else d2t_N[idx_B]
        return (token_B, state), (token_B, logits_BxN, q_BxN)

    state0 = (markov_head.init_state((batch,)) if markov_head is not None
              else jnp.zeros((batch, 0), jnp.float32))
    # The h_k half of every slot's gate / RNN input, in one product before the sequential loop.
    hx_BxGx = None if markov_head is None else markov_head.slot_inputs(h_BxGxd)
    hx_GxBx = None if hx_BxGx is None else jnp.moveaxis(hx_BxGx, 1, 0)
    xs = (jnp.moveaxis(base_logits_BxGxN, 1, 0), hx_GxBx, jnp.moveaxis(keys_BxG, 1, 0))
    carry0 = (anchor_B.astype(jnp.int32), state0)
    _, (tokens_GxB, logits_GxBxN, q_GxBxN) = jax.lax.scan(body, carry0, xs)

    tokens_BxG = tokens_GxB.T
    prev_tokens_BxG = jnp.concatenate([anchor_B.astype(jnp.int32)[:, None], tokens_BxG[:, :-1]], axis=1)
    return DraftBlock(
        tokens_BxG=tokens_BxG,
        corrected_logits_BxGxN=jnp.moveaxis(logits_GxBxN, 0, 1),
        q_BxGxV=scatter_to_target(jnp.moveaxis(q_GxBxN, 0, 1), d2t_N, vocab_size),
        prev_tokens_BxG=prev_tokens_BxG,
    )
