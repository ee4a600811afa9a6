"""Produce the SpecForge reference goldens that ``tests/test_specforge.py`` checks in CI.

SpecForge (``sgl-project/SpecForge``: SGLang's drafter training framework) exports DSpark drafters
as ``DSparkDraftModel`` and DFlash ones as ``DFlashDraftModel``: a Qwen3 config with the drafter's
fields in a nested ``dflash_config``, tensors under DeepSpec's names. This script imports
SpecForge's own model and training classes from a checkout (``--specforge DIR``, the directory
holding its ``specforge`` package: ``git archive HEAD specforge`` of the repository; commit
a6b6b02, 2026-08-08, was used) and needs torch and transformers (the venv of
``scripts/make_speculators_goldens.py`` has them) and triton (its EAGLE-3 trainer imports its
kernels; ``pip install triton``; nothing here runs them)::

    HF_HUB_OFFLINE=1 /tmp/specvenv/bin/python scripts/make_specforge_goldens.py --specforge /tmp/specforge

CI needs none of it: it reads what this script wrote.

For each variant (``VARIANTS``) SpecForge's drafter class is built on a tiny Qwen3 config with
seeded random weights (norms included, so that a skipped one shows) and saved with
``save_pretrained`` (``tests/fixtures/tiny_specforge/<variant>/``: the export as SpecForge writes
it). Then SpecForge's training forward (``OnlineDSparkModel`` or ``OnlineDFlashModel``, eager
attention over its dense training masks) runs on random tapped features and tokens, and
``tests/goldens/tiny_specforge.npz`` keeps the inputs (the target's embedding, which is its tied
head too, the features, tokens and sampled anchors) and, for each anchored block, the hidden
states the loss receives, the logits it scores (Markov-corrected for DSpark: the drafter's own
``apply_logits_head``) and the confidence logits (``predict_confidence``). It also keeps the
logits of each step of SpecForge's EAGLE-3 training-time-test loop over two of the EAGLE-3
fixtures ``make_speculators_goldens.py`` writes (``EAGLE_VARIANTS``; run that script first).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_deepspec_goldens import randomize  # noqa: E402  (seeded weights, norms around 1)

# The tiny target of the other goldens, and the EAGLE-3 fixtures and inputs that script writes.
from make_speculators_goldens import EAGLE_FIXTURES, TARGET, TTT_STEPS  # noqa: E402
from make_speculators_goldens import GOLDEN as EAGLE_INPUTS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "tiny_specforge"
GOLDEN = REPO / "tests" / "goldens" / "tiny_specforge.npz"
DRAFT_LAYERS = 2
TARGET_LAYERS = 4
# SpecForge numbers taps by decoder layer (its features are hidden_states[id + 1]), as we do.
COMMON = dict(target_layer_ids=[0, 2], mask_token_id=3)
BLOCK_SIZE = 4
VARIANTS = {
    # DSpark as SpecForge's configs train it (all of them vanilla or gated, with a confidence head
    # on the Markov feature), and its RNN head with a confidence head on the hidden state alone.
    "dspark_gated": dict(architecture="DSparkDraftModel", markov_head_type="gated", markov_rank=8,
                         enable_confidence_head=True, confidence_head_with_markov=True, confidence_head_alpha=1.0),
    "dspark_rnn": dict(architecture="DSparkDraftModel", markov_head_type="rnn", markov_rank=8,
                       enable_confidence_head=True, confidence_head_with_markov=False, confidence_head_alpha=1.0),
    # DSpark on DFlash's sliding-window layout, which its class inherits (its configs use full attention).
    "dspark_sliding": dict(architecture="DSparkDraftModel", markov_head_type="vanilla", markov_rank=8,
                           enable_confidence_head=True, confidence_head_with_markov=True, confidence_head_alpha=1.0,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    # DFlash with a sliding-window layer before a full-attention one (its Qwen3.6 config's layout),
    # the window shorter than the context the anchors have.
    "dflash_sliding": dict(architecture="DFlashDraftModel", layer_types=["sliding_attention", "full_attention"],
                           sliding_window=6),
}
SEQUENCE = 24
ANCHORS = 3
PROMPT = 10  # no anchors in the prompt: every anchor has more context than the window
# EAGLE-3 checkpoints in SpecForge's and the EAGLE authors' layout: the fixtures and inputs
# ``make_speculators_goldens.py`` writes (run it first), loaded by SpecForge's own
# ``LlamaForCausalLMEagle3`` and run through its training-time-test loop (``OnlineEagle3Model``).
# Not its EAGLE 3.1 one: SpecForge reads ``norm_output`` otherwise than vLLM (``checkpoints.eagle``).
EAGLE_VARIANTS = ("specforge", "authors")


def drafter(name: str, seed: int):
    """SpecForge's drafter of the variant, seeded random weights, and the target's embedding."""
    import torch
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from transformers import Qwen3Config

    variant = dict(VARIANTS[name])
    architecture = variant.pop("architecture")
    kinds = variant.pop("layer_types", ["full_attention"] * DRAFT_LAYERS)
    window = variant.pop("sliding_window", None)
    config = Qwen3Config(**TARGET, num_hidden_layers=DRAFT_LAYERS, layer_types=kinds, sliding_window=window,
                         use_sliding_window=window is not None)
    config.architectures = [architecture]
    config.block_size = BLOCK_SIZE
    config.num_target_layers = TARGET_LAYERS
    config.dflash_config = {**COMMON, **variant,
                            **({"projector_type": "dspark", "attention_mode": "gqa"} if "markov_rank" in variant else {})}
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (DSparkDraftModel if architecture == "DSparkDraftModel" else DFlashDraftModel)(config).eval()
    randomize(model)
    embedding = 0.2 * torch.randn(TARGET["vocab_size"], TARGET["hidden_size"])
    return model, embedding


def computed(model, embedding, seed: int) -> dict[str, np.ndarray]:
    """What SpecForge's training forward computes for each anchored block of random features and
    tokens: the hidden states its loss receives, the logits it scores and the confidence logits."""
    import torch
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel, OnlineDSparkModel
    from torch import nn

    vocab, width = embedding.shape
    embed_tokens = nn.Embedding(vocab, width, _weight=embedding.clone())
    lm_head = nn.Linear(width, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(embedding)  # the tiny target's head is tied
    dspark = hasattr(model, "markov_head")
    online = (OnlineDSparkModel if dspark else OnlineDFlashModel)(
        draft_model=model, target_lm_head=lm_head, target_embed_tokens=embed_tokens,
        mask_token_id=COMMON["mask_token_id"], block_size=BLOCK_SIZE, attention_backend="sdpa",
        num_anchors=ANCHORS, objective_chunk_blocks=0)
    generator = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(1, SEQUENCE, len(COMMON["target_layer_ids"]) * width, generator=generator)
    input_ids = torch.randint(4, vocab, (1, SEQUENCE), generator=generator)
    loss_mask = torch.ones(1, SEQUENCE)
    loss_mask[:, :PROMPT] = 0
    captured = {}
    blocks = online._forward_draft_blocks

    def keep_blocks(*args, **kwargs):
        captured["anchors"], _, captured["hidden"] = result = blocks(*args, **kwargs)
        return result

    online._forward_draft_blocks = keep_blocks
    if dspark:  # the heads' own outputs, as the loss receives them
        heads = model.apply_logits_head, model.predict_confidence

        def keep_logits(*args, **kwargs):
            captured["logits"] = result = heads[0](*args, **kwargs)
            return result

        def keep_confidence(*args, **kwargs):
            captured["confidence"] = result = heads[1](*args, **kwargs)
            return result

        model.apply_logits_head, model.predict_confidence = keep_logits, keep_confidence
    torch.manual_seed(seed + 2)  # the anchors SpecForge samples
    with torch.no_grad():
        online(input_ids=input_ids, hidden_states=features, loss_mask=loss_mask,
               **({"target_last_hidden_states": torch.randn(1, SEQUENCE, width, generator=generator)}
                  if dspark else {}))
    anchors = captured["anchors"][0]
    assert len(anchors) == ANCHORS and int(anchors.min()) >= PROMPT, anchors
    hidden = captured["hidden"][0].view(ANCHORS, BLOCK_SIZE, width)
    logits = captured["logits"][0] if dspark else lm_head(hidden)  # DFlash scores the target head's logits
    result = {"features": features[0], "input_ids": input_ids[0], "anchors": anchors, "embedding": embedding,
              "hidden": hidden, "corrected_logits": logits.reshape(ANCHORS, BLOCK_SIZE, vocab)}
    if dspark:
        result["confidence_logits"] = captured["confidence"][0].reshape(ANCHORS, BLOCK_SIZE)
    return {key: value.detach().numpy() for key, value in result.items()}


def make_eagle(name: str) -> dict[str, np.ndarray]:
    """The logits of each step of SpecForge's training-time-test loop over an EAGLE-3 fixture, on
    the speculators golden's features and tokens for it, aligned as SpecForge's data pipeline
    aligns them (token t + 1 with the features of position t)."""
    import torch
    from safetensors.torch import load_file
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    inputs = np.load(EAGLE_INPUTS)
    embedding = torch.from_numpy(inputs[f"eagle/{name}/embedding"])
    features = torch.from_numpy(inputs[f"eagle/{name}/features"])[None, :-1]
    ids = torch.from_numpy(inputs[f"eagle/{name}/input_ids"])[None, 1:]
    # Built, then given the checkpoint's tensors: transformers 5's from_pretrained builds on the
    # meta device, which leaves the rotary tables SpecForge's attention computes at init unset.
    model = LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(EAGLE_FIXTURES / name), attention_backend="sdpa").eval()
    missing, unexpected = model.load_state_dict(load_file(EAGLE_FIXTURES / name / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight"}, (missing, unexpected)
    with torch.no_grad():  # SpecForge's trainer loads the target's embedding (load_embedding)
        model.embed_tokens.weight.copy_(embedding)
    online = OnlineEagle3Model(draft_model=model, length=TTT_STEPS, attention_backend="sdpa")
    steps = []

    def keep_logits(*, logits, **_):  # each step's logits; its loss (triton kernels) is not needed
        steps.append(logits[0])
        return (torch.zeros(()),) * 7

    online._acc_and_loss = keep_logits
    length = ids.shape[1]
    with torch.no_grad():
        online(input_ids=ids, attention_mask=torch.ones(1, length, dtype=torch.long),
               target=torch.randn(1, length, embedding.shape[0]), loss_mask=torch.ones(1, length, 1),
               hidden_states=features)
    assert len(steps) == TTT_STEPS
    return {"logits": torch.stack(steps).numpy()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specforge", required=True, help="the directory holding SpecForge's specforge package")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.specforge).resolve()))
    arrays = {}
    for name in VARIANTS:
        seed = zlib.crc32(name.encode())
        model, embedding = drafter(name, seed)
        out = FIXTURES / name
        model.save_pretrained(out, safe_serialization=True)
        arrays |= {f"{name}/{key}": value for key, value in computed(model, embedding, seed).items()}
    for name in EAGLE_VARIANTS:
        arrays |= {f"eagle/{name}/{key}": value for key, value in make_eagle(name).items()}
    np.savez_compressed(GOLDEN, **arrays)
    print(json.dumps({name: sorted(p.name for p in (FIXTURES / name).iterdir()) for name in VARIANTS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
