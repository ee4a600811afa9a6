"""The EAGLE-3 baseline of the accelerator run: one autoregressive layer over the same tapped
features and 4096-token head, trained by training-time test over γ = 7 steps on
``smollm2_135m_accel_dspark.py``'s data, cache and budget."""

from pathlib import Path

from dspark_jax.training.train import load_config, same_legs

_DRAFTER = dict(kind="eagle3", mask_token_id=0, block_size=7, draft_vocab_size=4096)
CONFIG = same_legs(load_config(Path(__file__).with_name("smollm2_135m_accel_dspark.py")), _DRAFTER, ("dspark", "eagle3"))
