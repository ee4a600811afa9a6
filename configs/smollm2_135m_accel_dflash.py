"""The DFlash baseline of the accelerator run: ``smollm2_135m_accel_dspark.py``'s data, cache,
backbone, head and budget, without the Markov and confidence heads, trained with CE only."""

from pathlib import Path

from dspark_jax.training.train import load_config, same_legs

_DRAFTER = dict(kind="dflash", mask_token_id=0, block_size=7, draft_vocab_size=4096)
CONFIG = same_legs(load_config(Path(__file__).with_name("smollm2_135m_accel_dspark.py")), _DRAFTER, ("dspark", "dflash"))
