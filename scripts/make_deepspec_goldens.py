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

DeepSpec's EAGLE-3 baseline (``Qwen3Eagle3Model``, as ``deepseek-ai/eagle3_qwen3_4b_ttt7`` is
published) is made the same way on a tiny target of 6 layers (DeepSpec taps exactly 5, none the
last), with the target's embedding as its frozen copy and a head of its own, and its evaluator's
own methods (``Qwen3Eagle3Evaluator._init_context``, ``_propose``, ``_update``) draft greedily
after a prompt, commit two tokens and draft again: ``eagle3/...`` keeps the inputs and each
step's logits of both rounds.

Usage: ``python scripts/make_deepspec_goldens.py --deepspec /path/to/DeepSpec``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

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


def randomize(model) -> None:
    """Seeded random weights, norms too (around 1), so that a skipped one shows."""
    import torch

    with torch.no_grad():
        for param_name, param in model.named_parameters():
            spread = 0.2 if param.ndim > 1 else 0.5
            param.copy_((1.0 if param_name.endswith("norm.weight") else 0.0) + spread * torch.randn_like(param))


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
    randomize(model)
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


EAGLE3_LAYERS, EAGLE3_TAPS, EAGLE3_TTT = 6, [0, 1, 2, 3, 4], 3
EAGLE3_PROMPT = 9  # tokens before the first proposal
EAGLE3_COMMITTED = 2  # tokens the round between the two proposals commits


def make_eagle3(deepspec: Path, seed: int) -> dict[str, np.ndarray]:
    import torch
    from transformers import Qwen3Config

    sys.path.insert(0, str(deepspec))
    from deepspec.eval.eagle3.evaluator import Qwen3Eagle3Evaluator
    from deepspec.modeling.eagle3.qwen3 import Qwen3Eagle3Model
    from deepspec.modeling.eagle3.qwen3.config import build_draft_config

    target = Qwen3Config(**{**TARGET, "num_hidden_layers": EAGLE3_LAYERS})
    config = build_draft_config(target_config=target, model_args=ModelArgs(
        target_model_name_or_path="tiny-qwen3", target_layer_ids=EAGLE3_TAPS, ttt_length=EAGLE3_TTT,
        step_loss_decay=0.8, draft_num_hidden_layers=1))
    config._attn_implementation = "sdpa"  # its evaluator's
    torch.manual_seed(seed)
    model = Qwen3Eagle3Model(config).eval()
    randomize(model)
    model.save_pretrained(FIXTURES / "eagle3", safe_serialization=True)

    generator = torch.Generator().manual_seed(seed + 1)
    width, vocab = TARGET["hidden_size"], TARGET["vocab_size"]
    length = EAGLE3_PROMPT + 1 + EAGLE3_COMMITTED + EAGLE3_TTT
    ids = torch.randint(4, vocab, (1, length), generator=generator)
    # The target's hidden states after each layer (index 0: the embedding output), for the prompt
    # and for the round that commits two tokens; DeepSpec taps hidden_states[id + 1].
    prompt_states = torch.randn(EAGLE3_LAYERS + 1, 1, EAGLE3_PROMPT, width, generator=generator)
    verified_states = torch.randn(EAGLE3_LAYERS + 1, 1, EAGLE3_TTT + 1, width, generator=generator)
    logits = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: logits.append(compute_logits(hidden)) or logits[-1]
    evaluator = Qwen3Eagle3Evaluator.__new__(Qwen3Eagle3Evaluator)  # its drafting methods, without a target
    evaluator.draft_model, evaluator.args = model, SimpleNamespace(temperature=0.0)
    position_ids = torch.arange(length)[None]
    with torch.no_grad():
        context = evaluator._init_context(initial_output=SimpleNamespace(hidden_states=list(prompt_states)),
                                          output_ids=ids, position_ids=position_ids, num_input_tokens=EAGLE3_PROMPT)
        evaluator._propose(context=context, output_ids=ids, position_ids=position_ids, start=EAGLE3_PROMPT)
        committed = ids[:, EAGLE3_PROMPT + 1:EAGLE3_PROMPT + 1 + EAGLE3_COMMITTED]
        evaluator._update(context, SimpleNamespace(committed_tokens=committed,
                                                   target_output=SimpleNamespace(hidden_states=list(verified_states))))
        evaluator._propose(context=context, output_ids=ids, position_ids=position_ids,
                           start=EAGLE3_PROMPT + EAGLE3_COMMITTED)
    taps = [i + 1 for i in EAGLE3_TAPS]
    result = {"embedding": model.embed_tokens.weight, "input_ids": ids[0],
              "prompt_features": torch.cat(list(prompt_states[taps]), dim=-1)[0],
              "verified_features": torch.cat(list(verified_states[taps]), dim=-1)[0],
              "logits": torch.cat(logits, dim=1)[0].reshape(2, EAGLE3_TTT, vocab)}
    return {f"eagle3/{key}": value.detach().numpy() for key, value in result.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepspec", type=Path, required=True, help="a checkout of deepseek-ai/DeepSpec")
    args = ap.parse_args(argv)
    arrays = {"context_rows": np.array(CONTEXT_ROWS), "anchor": np.array(ANCHOR)}
    for seed, name in enumerate(VARIANTS):
        arrays |= make(args.deepspec, name, seed)
    arrays |= make_eagle3(args.deepspec, len(VARIANTS))
    np.savez_compressed(GOLDEN, **arrays)
    print(json.dumps({name: sorted(p.name for p in (FIXTURES / name).iterdir()) for name in [*VARIANTS, "eagle3"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
