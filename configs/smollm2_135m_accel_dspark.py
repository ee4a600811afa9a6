"""DSpark for the embedded SmolLM2-135M-Instruct, trained from scratch in one run on an
accelerator (``docs/ACCELERATOR.md``): the run the shipped CPU drafters could not afford.

It is trained together with its two baselines (``smollm2_135m_accel_dflash.py``,
``smollm2_135m_accel_eagle3.py``) under one wall-clock budget, which picks the steps:

    dspark train --config configs/smollm2_135m_accel_dspark.py \\
        --config configs/smollm2_135m_accel_dflash.py --config configs/smollm2_135m_accel_eagle3.py \\
        --budget-s 420

Data: the target's answers (the shipped drafters' settings: T = 0.7, top-p 0.8, top-k 20, at most
160 new tokens) to the prompts of 60 fresh data seeds (100-159, cycling the paper, formats and
writing mixes: 33,162 distinct prompts after duplicates), answered 512 at a time until the
budget's data share runs out. The cache keeps token ids only: on an accelerator the frozen
target computes the features of each batch in the training step for less than storing 6.9 KB
a token would cost. Seeds 1 and 1000 (held-out scores, calibration) stay unused.
Drafter: the shipped one's shape (2 layers, 4096-token head, gated rank-256 Markov head with
draft-vocabulary W1 rows: 26 MB), so the two compare and the result can ship.
Training: batches of 64 sequences (8x the CPU legs'), peak lr 1e-3 from random weights.
"""

import dataclasses
from pathlib import Path

from dspark_jax.training.train import TrainConfig, load_config

# The shipped drafter: its answer settings, tapped layers and shape are this run's too.
SHIPPED = load_config(Path(__file__).with_name("smollm2_135m_dspark.py"))
MIXES = ("paper", "formats", "writing")
SEEDS = tuple(range(100, 160))

CONFIG = TrainConfig(
    name="smollm2_135m_accel_dspark",
    out_dir="runs/smollm2_135m_accel_dspark",
    cache_dir="runs/smollm2_135m_accel_cache",
    benchmarks_dir=SHIPPED.benchmarks_dir,
    num_prompts=640,
    data_seed=SEEDS,
    data_mix=tuple(MIXES[i % len(MIXES)] for i in range(len(SEEDS))),
    cache=dataclasses.replace(SHIPPED.cache, shard_size=1024, batch_size=512, store_features=False),
    drafter=SHIPPED.drafter,
    steps=2000,  # what `--budget-s` replaces
    batch_size=64,
    seq_len=SHIPPED.seq_len,
    num_anchors=SHIPPED.num_anchors,
    anchor_chunk=64,
    learning_rate=1e-3,
    checkpoint_every=1000,
)
