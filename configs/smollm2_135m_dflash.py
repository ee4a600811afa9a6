"""The DFlash baseline for SmolLM2-135M: the DSpark config's data, cache, backbone, vocabulary
head and step budget, without the Markov and confidence heads, trained with CE only (as
DeepSpec trains its DFlash baseline; spec §5.6), in the same legs."""

from pathlib import Path

from dspark_jax.training.train import load_config, same_legs

_DRAFTER = dict(kind="dflash", mask_token_id=0, block_size=7, draft_vocab_size=4096)
CONFIG = same_legs(load_config(Path(__file__).with_name("smollm2_135m_dspark.py")), _DRAFTER, ("dspark", "dflash"))
