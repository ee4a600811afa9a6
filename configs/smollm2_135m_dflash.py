"""The DFlash baseline for SmolLM2-135M: the DSpark config's data, cache, backbone, vocabulary
head and step budget, without the Markov and confidence heads, trained with CE only (as
DeepSpec trains its DFlash baseline; spec §5.6), in the same two legs."""

import dataclasses
from pathlib import Path

from dspark_jax.training.train import load_config

_DSPARK = load_config(Path(__file__).with_name("smollm2_135m_dspark.py"))
_DRAFTER = dict(kind="dflash", num_layers=1, mask_token_id=0, block_size=7, draft_vocab_size=4096)
_FIRST_LEG = dataclasses.replace(
    _DSPARK.init_from, name="smollm2_135m_dflash_first", out_dir="runs/smollm2_135m_dflash_first", drafter=_DRAFTER
)
CONFIG = dataclasses.replace(
    _DSPARK, name="smollm2_135m_dflash", out_dir="runs/smollm2_135m_dflash", drafter=_DRAFTER, init_from=_FIRST_LEG
)
