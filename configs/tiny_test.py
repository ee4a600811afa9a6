"""CI-sized end-to-end run: a tiny target (the embedded SmolLM2's first 2 layers, real weights),
a small DSpark drafter and 64 prompts; trains in about a minute on 2 CPU cores."""

from dspark_jax.training.target_cache import CacheSpec
from dspark_jax.training.train import TrainConfig

CONFIG = TrainConfig(
    name="tiny_test",
    out_dir="runs/tiny_test",
    target_layers=2,
    num_prompts=64,
    cache=CacheSpec(tap_layers=(0,), max_new_tokens=32, max_prompt_tokens=192, temperature=0.0,
                    shard_size=32, batch_size=16),
    drafter=dict(kind="dspark", mask_token_id=0, block_size=4, markov_rank=16, draft_vocab_size=512),
    steps=40,
    batch_size=4,
    seq_len=256,
    num_anchors=16,
    anchor_chunk=16,
    learning_rate=3e-3,
    checkpoint_every=10,
    heldout_prompts=8,
    heldout_every=10,
)
