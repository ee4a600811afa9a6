"""Greedy decoding replayed from cached greedy answers equals real greedy speculative decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.checkpoints.drafter import load_drafter
from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
from dspark_jax.drafters import shipped_drafter_path
from dspark_jax.eval.metrics import per_position_acceptance
from dspark_jax.eval.replay import jit_with_drafter, replay_rounds, replay_sequences, replay_summary
from dspark_jax.training.losses import greedy_chains
from dspark_jax.training.target_cache import CachedSequence
from tests.prompts import QUESTIONS

NEW = 32


def test_replay_rounds_by_hand():
    mask = np.array([0, 0] + [1] * 10)  # answer = positions 2..11
    chain = np.zeros(12, int)
    chain[[2, 3, 5, 9]] = [2, 1, 3, 2]
    # Anchor 2 accepts 2 and commits 3 (next anchor 5), 5 accepts 3 (-> 9), 9 accepts 2.
    rounds = replay_rounds(chain, mask, finished=False, max_new_tokens=9)
    np.testing.assert_array_equal(rounds.accepted, [2, 3, 2])
    np.testing.assert_array_equal(rounds.committed, [3, 4, 3])  # the last past the cached answer's cap
    # The budget ends decoding once 8 are committed: 1 + 3 + 4 = 8 after two rounds.
    np.testing.assert_array_equal(replay_rounds(chain, mask, finished=False, max_new_tokens=8).accepted, [2, 3])
    # A finished answer (its last token, position 11, a stop) ends at the stop even with budget
    # left. The last round accepts the stop as its second draft: it commits 2, no target token.
    rounds = replay_rounds(chain, mask, finished=True, max_new_tokens=50)
    np.testing.assert_array_equal(rounds.accepted, [2, 3, 2])
    np.testing.assert_array_equal(rounds.committed, [3, 4, 2])
    # A stop that is the target's token after the drafts ends a round that commits accepted + 1.
    chain[9] = 1
    rounds = replay_rounds(chain, mask, finished=True, max_new_tokens=50)
    np.testing.assert_array_equal(rounds.accepted, [2, 3, 1])
    np.testing.assert_array_equal(rounds.committed, [3, 4, 2])
    with pytest.raises(ValueError, match="cannot replay 20 new tokens"):
        replay_rounds(chain, mask, finished=False, max_new_tokens=20)
    with pytest.raises(ValueError, match="no answer tokens"):
        replay_rounds(chain, np.zeros(12, int), finished=False, max_new_tokens=4)


def cached_answer(target, taps, prompt, answer):
    """prompt + answer as the target cache holds it, with float32 features (decoding's dtype)."""
    tokens = jnp.asarray([prompt + answer], jnp.int32)
    module = target.module(target.params)
    out = module(tokens, target.new_cache(1, tokens.shape[1]), n_new_B=jnp.asarray([tokens.shape[1]]),
                 logits_at_B=jnp.zeros(1, jnp.int32), tap_layers=tuple(taps) + (target.cfg.num_layers - 1,))
    d = target.cfg.hidden_size
    hidden = module.final_norm(out.taps[0, :, -d:])
    lse = jax.nn.logsumexp(hidden @ target.embedding_and_head(target.params)[1].T, axis=-1)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(answer))].astype(np.uint8)
    return CachedSequence("p", np.asarray(tokens[0]), mask, np.asarray(out.taps[0, :, :-d]), np.asarray(hidden),
                          np.asarray(lse))


# DFlash shares DSpark's block path (without the Markov head); docs/BENCHMARKS.md shows its replay
# matching the benchmark too.
@pytest.mark.parametrize("name", ["smollm2_135m_dspark", "smollm2_135m_eagle3"])
def test_replay_equals_greedy_decoding_with_the_shipped_drafters(embedded_target, name):
    """Round by round, the accepted counts replayed from the greedy answer are the decoder's.
    The trained drafters accept runs of several drafts, so every chain is exercised."""
    target, tokenizer = embedded_target
    drafter = load_drafter(shipped_drafter_path(name), target=target.cfg)
    gamma = drafter.cfg.block_size
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[2]}])
    # The answer runs γ + 1 tokens past the replayed budget, as a real decode's last round drafts
    # past it; the longer decode's first rounds are those of a NEW-token decode.
    decoded = SpeculativeDecoder(target, drafter, policy=FixedPolicy(gamma)).generate(
        [prompt], max_new_tokens=NEW + gamma + 1, max_len=192)
    sequence = cached_answer(target, drafter.cfg.tap_layers, prompt, decoded.tokens[0])
    embed, head = target.embedding_and_head(target.params)
    chains = jit_with_drafter(greedy_chains, drafter, embed, head)
    replayed = replay_sequences(chains, [sequence], max_new_tokens=NEW, stop_ids=())[sequence.name]
    accepted = np.concatenate(decoded.accepted_per_round)[: replayed.accepted.size]
    np.testing.assert_array_equal(replayed.accepted, accepted)
    np.testing.assert_array_equal(replayed.committed, np.concatenate(decoded.committed_per_round)[: accepted.size])
    assert 1 + (accepted[:-1] + 1).sum() < NEW <= 1 + (accepted + 1).sum()  # the rounds a NEW-token decode runs
    assert accepted.max() >= 2 and accepted.min() == 0
    summary = replay_summary({sequence.name: replayed}, gamma)
    np.testing.assert_allclose(summary["tau"], np.mean(accepted + 1))
    np.testing.assert_allclose(summary["per_position_acceptance"],
                               per_position_acceptance(accepted, np.full(accepted.size, gamma), gamma))
