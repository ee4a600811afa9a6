"""Greedy speculative decoding replayed from a target cache of greedy answers.

Greedy verification accepts draft slot k iff it and every slot before it equal the target's
argmax, and greedy decoding commits exactly the target's greedy answer. So on a cached greedy
answer the rounds of a real decode are fixed by each anchor's teacher-forced greedy chain
(``training.losses.greedy_chains``: how many leading slots the drafter gets right there):

- the prefill commits the answer's first token; the first round's anchor is that token;
- a round at anchor ``a`` accepts ``chain[a]`` drafts and commits them and the target's next
  token, and the next round's anchor is the last token it committed;
- decoding ends once ``max_new_tokens`` are committed, or with the answer's stop token (a round
  that accepts the stop as a draft commits the drafts through it and no target token, spec §6.4).

This is the fixed-width policy (every round verifies all γ slots), which is what
``scripts/bench_speculative.py`` runs by default; it gives the same τ and per-position
acceptance as decoding without running the target (about 0.4 s a prompt and drafter on 2 CPU
cores). The cache's features are bfloat16 where decoding's are float32, so a draft whose top two
logits nearly tie can go the other way; the agreement is measured in ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from dspark_jax.eval.metrics import per_position_acceptance, tau_of
from dspark_jax.training.losses import TrainBatch
from dspark_jax.training.target_cache import CachedSequence
from dspark_jax.training.train import anchor_candidates

PAD_TO = 64  # sequences are padded to a multiple of this


def jit_with_drafter(fn: Callable, drafter, *weights) -> Callable:
    """``fn(drafter, *weights, *args)`` compiled, as a function of ``*args`` (one compile per
    shape). The drafter's parameters and ``weights`` (the target's embedding and LM head) enter
    the program as arguments: closed over, they would be constants XLA folds at every compile
    (replaying the shipped DSpark drafter's chains compiled in 23 s that way on 2 CPU cores)."""
    graph, state = nnx.split(drafter)
    compiled = jax.jit(lambda state, *rest: fn(nnx.merge(graph, state), *rest))
    return functools.partial(compiled, state, *weights)


class ReplayedRounds(NamedTuple):
    """Per round of one replayed decode, as ``SpeculativeResult`` logs them."""

    accepted: np.ndarray  # drafts the target accepts
    committed: np.ndarray  # tokens committed: accepted + 1, or the drafts through the stop token


def replay_rounds(chain_S: np.ndarray, loss_mask_S: np.ndarray, *, finished: bool,
                  max_new_tokens: int) -> ReplayedRounds:
    """The rounds of greedy decoding along one cached greedy answer.

    ``chain_S[a]`` is the greedy chain of the block anchored at position ``a`` (only response
    positions are read); ``loss_mask_S`` marks the answer; ``finished`` says whether the answer
    ends with a stop token (decoding stops there) rather than at the cache's length cap (then it
    must hold ``max_new_tokens`` tokens).
    """
    response = np.flatnonzero(np.asarray(loss_mask_S) != 0)
    if response.size == 0:
        raise ValueError("the sequence has no answer tokens")
    first, end = int(response[0]), int(response[-1]) + 1
    if not finished and end - first < max_new_tokens:
        raise ValueError(f"the cached answer has {end - first} tokens and no stop token: it cannot replay "
                         f"{max_new_tokens} new tokens (answer with a larger cap, or replay fewer)")
    accepted, committed = [], []
    total, anchor = 1, first  # the prefill's token
    while total < max_new_tokens and anchor + 1 < end:
        drafts = int(chain_S[anchor])
        # The round's drafts and the target's token after them, or up to the stop token. An
        # unfinished answer's end is only the cache's cap: the round commits past it.
        step = min(drafts + 1, end - 1 - anchor)
        accepted.append(drafts)
        committed.append(step if finished else drafts + 1)
        total, anchor = total + step, anchor + step
    return ReplayedRounds(np.asarray(accepted, np.int64), np.asarray(committed, np.int64))


def anchor_batch(seq: CachedSequence, seq_len: int, num_anchors: int) -> TrainBatch:
    """One sequence as a batch of one, padded to ``seq_len``, with its first ``num_anchors``
    response anchors (a replay of N new tokens starts rounds at the first N at most)."""
    n = len(seq.input_ids)
    if n > seq_len:
        raise ValueError(f"sequence {seq.name} has {n} tokens, more than seq_len {seq_len}")

    def padded(x, dtype=None):
        out = np.zeros((1, seq_len, *np.shape(x)[1:]), dtype or np.asarray(x).dtype)
        out[0, :n] = x
        return out

    candidates = anchor_candidates(seq.loss_mask)[:num_anchors]
    anchors = np.zeros((1, num_anchors), np.int32)
    keep = np.zeros((1, num_anchors), bool)
    anchors[0, : candidates.size], keep[0, : candidates.size] = candidates, True
    return TrainBatch(padded(seq.input_ids, np.int32), padded(seq.loss_mask), padded(seq.features),
                      padded(seq.hidden), anchors, keep, padded(seq.lse, np.float32))


def replay_sequences(chains: Callable[[TrainBatch], np.ndarray], sequences: Sequence[CachedSequence], *,
                     max_new_tokens: int, stop_ids: Sequence[int]) -> dict[str, ReplayedRounds]:
    """Replay greedy decoding of ``max_new_tokens`` along every sequence (greedy answers):
    ``{name: its rounds}``. ``chains`` maps a batch to its ``[1, A]`` greedy
    chains (``greedy_chains`` of one drafter, jitted: ``jit_with_drafter(greedy_chains, drafter,
    embed, head)``)."""
    stops = {int(s) for s in stop_ids}
    # One padded length for the whole set, so ``chains`` compiles once.
    seq_len = PAD_TO * -(-max((len(s.input_ids) for s in sequences), default=1) // PAD_TO)
    rounds = {}
    for seq in sequences:
        batch = anchor_batch(seq, seq_len, max_new_tokens)
        keep = batch.keep_BxA[0]
        chain_S = np.zeros(seq_len, np.int64)
        chain_S[batch.anchors_BxA[0][keep]] = np.asarray(chains(batch))[0][keep]
        rounds[seq.name] = replay_rounds(chain_S, seq.loss_mask, finished=int(seq.input_ids[-1]) in stops,
                                         max_new_tokens=max_new_tokens)
    return rounds


def replay_summary(rounds: dict[str, ReplayedRounds], gamma: int) -> dict:
    """What the benchmark reports of a set of prompts' rounds: ``tau`` (mean tokens committed
    over all rounds), ``per_position_acceptance``, ``rounds`` and ``per_sequence`` τ."""
    accepted = np.concatenate([r.accepted for r in rounds.values()]) if rounds else np.zeros(0, np.int64)
    return {
        "tau": tau_of([r.committed for r in rounds.values()]),
        "per_position_acceptance": per_position_acceptance(accepted, np.full(accepted.shape, gamma), gamma).tolist(),
        "rounds": int(accepted.size),
        "per_sequence": {name: tau_of([r.committed]) if r.committed.size else None for name, r in rounds.items()},
    }
