"""The EAGLE-3 baseline for SmolLM2-135M: one autoregressive layer over the same tapped
features and the same 4096-token reduced head (EAGLE-3 drafts over a reduced vocabulary too),
trained by training-time test over γ = 7 steps (spec §8.2) on the DSpark config's
data and cache, with the same step budget, in the same legs."""

from pathlib import Path

from dspark_jax.training.train import load_config, same_legs

_DRAFTER = dict(kind="eagle3", mask_token_id=0, block_size=7, draft_vocab_size=4096)
CONFIG = same_legs(load_config(Path(__file__).with_name("smollm2_135m_dspark.py")), _DRAFTER, ("dspark", "eagle3"))
