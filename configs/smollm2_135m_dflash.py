"""The DFlash baseline for SmolLM2-135M: the DSpark config's data, cache, backbone, vocabulary
head and step budget, without the Markov and confidence heads, trained with CE only (as
DeepSpec trains its DFlash baseline; spec §5.6)."""

import dataclasses
from pathlib import Path

from dspark_jax.training.train import load_config

_DSPARK = load_config(Path(__file__).with_name("smollm2_135m_dspark.py"))
CONFIG = dataclasses.replace(
    _DSPARK,
    name="smollm2_135m_dflash",
    out_dir="runs/smollm2_135m_dflash",
    drafter=dict(kind="dflash", num_layers=1, mask_token_id=0, block_size=7, draft_vocab_size=4096),
)
