"""The shipped DSpark drafter for the embedded SmolLM2-135M-Instruct target, sized for a CPU.

Data: the target's own answers (T=0.7, top-p 0.8, top-k 20, the paper's regeneration settings)
to 640 prompts of the offline mix in ``training/data.py`` (checked against the benchmark sets);
sequences are at most 256 + 160 tokens, and ``seq_len`` 352 keeps 99.98% of the response tokens
while sparing the padding that 512 cost every step.
Drafter: 1 layer (not DeepSpec's 5: on 2 CPU cores every drafter layer costs verify time),
5 tapped layers spread like DeepSpec's, γ = 7, vanilla Markov head of rank 64, a 4096-token
reduced head (its size decides the sequential head's per-token cost on CPU), confidence head.
Training: two legs of 500 steps on the same data. The first starts from random weights at
peak lr 1e-3 and decays to 0; the second restarts from the first's drafter with a fresh
warm-up + cosine at half the peak and new anchor samples (seed 43). On this CPU the τ curve was
still rising when the first leg's schedule ended; splitting the run keeps the first leg a
usable drafter on its own. The DFlash and EAGLE-3 configs reuse this data, cache and step budget.
"""

import dataclasses
from pathlib import Path

from dspark_jax.training.target_cache import CacheSpec
from dspark_jax.training.train import TrainConfig

FIRST_LEG = TrainConfig(
    name="smollm2_135m_dspark_first",
    out_dir="runs/smollm2_135m_dspark_first",
    cache_dir="runs/smollm2_135m_cache",
    # The benchmark prompt sets next to the repository; training prompts must not overlap them.
    benchmarks_dir=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks"),
    num_prompts=640,
    cache=CacheSpec(tap_layers=(1, 8, 15, 22, 28), max_new_tokens=160, max_prompt_tokens=256,
                    temperature=0.7, top_p=0.8, top_k=20, shard_size=64, batch_size=16),
    drafter=dict(kind="dspark", num_layers=1, mask_token_id=0, block_size=7, markov_rank=64,
                 draft_vocab_size=4096),
    steps=500,
    batch_size=8,
    seq_len=352,
    num_anchors=64,
    anchor_chunk=32,
    learning_rate=1e-3,
    checkpoint_every=50,
)
CONFIG = dataclasses.replace(
    FIRST_LEG,
    name="smollm2_135m_dspark",
    out_dir="runs/smollm2_135m_dspark",
    init_from=FIRST_LEG,
    learning_rate=5e-4,
    seed=43,
)
