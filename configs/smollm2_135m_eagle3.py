"""The EAGLE-3 baseline for SmolLM2-135M: one autoregressive layer over the same tapped
features and the same 4096-token reduced head (EAGLE-3 drafts over a reduced vocabulary too),
trained by training-time test over γ = 7 steps (spec §8.2) on the DSpark config's
data and cache, with the same step budget, in the same two legs."""

import dataclasses
from pathlib import Path

from dspark_jax.training.train import load_config

_DSPARK = load_config(Path(__file__).with_name("smollm2_135m_dspark.py"))
_DRAFTER = dict(kind="eagle3", mask_token_id=0, block_size=7, draft_vocab_size=4096)
_FIRST_LEG = dataclasses.replace(
    _DSPARK.init_from, name="smollm2_135m_eagle3_first", out_dir="runs/smollm2_135m_eagle3_first", drafter=_DRAFTER
)
CONFIG = dataclasses.replace(
    _DSPARK, name="smollm2_135m_eagle3", out_dir="runs/smollm2_135m_eagle3", drafter=_DRAFTER, init_from=_FIRST_LEG
)
