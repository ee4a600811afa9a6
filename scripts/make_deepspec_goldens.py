"""Produce the DeepSpec reference goldens that ``tests/test_deepspec.py`` checks in CI.

DeepSpec (``deepseek-ai/DeepSpec``, the official DSpark code) is not a package: give this script
a checkout of it (``--deepspec DIR``); it also needs torch and transformers
(``pip install -e '.[torch-ref]'``). CI needs neither: it reads what this script wrote.

For each variant (a gated Markov head with a confidence head on its features and a bias; an RNN
head with a confidence head on the hidden state alone; DFlash, with neither), DeepSpec's own
``build_draft_config`` makes the drafter config of a tiny Qwen3 target, ``Qwen3DSparkModel`` is
built on it with seeded random weights (norms included) and saved with ``save_pretrained``
(``tests/fixtures/tiny_deepspec/<variant>/``: the real format). Then DeepSpec's evaluator
functions draft one block after random context features (``forward_dspark_draft_block``, its
``compute_logits`` / ``sample_draft_tokens`` / confidence step, greedy), and
``tests/goldens/tiny_deepspec.npz`` keeps the inputs and what came out: the block's hidden
states, base logits, greedy tokens, Markov-corrected logits and confidence logits.

Usage: ``python scripts/make_deepspec_goldens.py --deepspec /path/to/DeepSpec``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "tiny_deepspec"
GOLDEN = REPO / "tests" / "goldens" / "tiny_deepspec.npz"
TARGET = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
              tie_word_embeddings=True)
COMMON = dict(num_draft_layers=2, target_layer_ids=[0, 2], block_size=4, mask_token_id=3, num_anchors=8)
VARIANTS = {
    "gated": dict(markov_rank=8, markov_head_type="gated", confidence_head_alpha=1.0, confidence_head_with_markov=True),
    "rnn": dict(markov_rank=8, markov_head_type="rnn", confidence_head_alpha=1.0, confidence_head_with_markov=False),
    "dflash": dict(markov_rank=0, confidence_head_alpha=0.0),
}
CONTEXT_ROWS = 9
ANCHOR = 11


class ModelArgs(dict):
    """DeepSpec reads its model arguments both as ``key in args`` and as ``args.key``."""

    __getattr__ = dict.__getitem__


def make(deepspec: Path, name: str, seed: int) -> dict[str, np.ndarray]:
    import torch
    from transformers import DynamicCache, Qwen3Config

    sys.path.insert(0, str(deepspec))
    from deepspec.eval.dspark.draft_ops import forward_dspark_draft_block
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from deepspec.modeling.dspark.qwen3.config import build_draft_config

    config = build_draft_config(Qwen3Config(**TARGET), ModelArgs(**COMMON, **VARIANTS[name]))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3DSparkModel(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():  # norms too, so that a skipped one shows
            spread = 0.2 if param.ndim > 1 else 0.5
            param.copy_((1.0 if param_name.endswith("norm.weight") else 0.0) + spread * torch.randn_like(param))
    out = FIXTURES / name
    model.save_pretrained(out, safe_serialization=True)
    generator = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(1, CONTEXT_ROWS, len(COMMON["target_layer_ids"]) * TARGET["hidden_size"], generator=generator)
    gamma = COMMON["block_size"]
    draft_input_ids = torch.tensor([[ANCHOR] + [COMMON["mask_token_id"]] * (gamma - 1)])
    position_ids = torch.arange(CONTEXT_ROWS + gamma)[None]
    with torch.no_grad():
        hidden = forward_dspark_draft_block(model, draft_input_ids=draft_input_ids, position_ids=position_ids,
                                            past_key_values_draft=DynamicCache(), target_hidden_states=features,
                                            start=CONTEXT_ROWS, block_size=gamma)[:, :gamma]
        base = model.compute_logits(hidden)
        tokens, corrected = model.sample_draft_tokens(base, first_prev_token_ids=draft_input_ids[:, 0],
                                                      temperature=0.0, hidden_states=hidden)
        prev = torch.cat([draft_input_ids[:, :1], tokens[:, :-1]], dim=1)
        confidence = model.predict_confidence_step(hidden, prev_token_ids=prev)
    result = {"features": features[0], "hidden": hidden[0], "base_logits": base[0], "tokens": tokens[0],
              "corrected_logits": corrected[0]}
    if confidence is not None:
        result["confidence_logits"] = confidence[0]
    return {f"{name}/{key}": value.numpy() for key, value in result.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepspec", type=Path, required=True, help="a checkout of deepseek-ai/DeepSpec")
    args = ap.parse_args(argv)
    arrays = {"context_rows": np.array(CONTEXT_ROWS), "anchor": np.array(ANCHOR)}
    for seed, name in enumerate(VARIANTS):
        arrays |= make(args.deepspec, name, seed)
    np.savez_compressed(GOLDEN, **arrays)
    print(json.dumps({name: sorted(p.name for p in (FIXTURES / name).iterdir()) for name in VARIANTS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
