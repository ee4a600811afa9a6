"""Produce the z-lab DFlash reference goldens that ``tests/test_zlab.py`` checks in CI.

z-lab's DFlash code (``z-lab/dflash``, ``dflash/model.py``) is not on PyPI: give this script a
checkout of it (``--dflash DIR``) recent enough that its ``Qwen3DFlashAttention`` resolves each
layer's causality and window (``_attention_mask``: a ``sliding_attention`` layer is causal unless
the config's ``is_causal`` says otherwise, and sees the ``sliding_window`` positions up to its own
query's, itself included). It needs torch and transformers 5 (the venv of
``scripts/make_speculators_goldens.py`` has them). CI needs none of them: it reads what this
script wrote. The committed goldens were made with the model classes of that file at commit
10129599 (as the public code index holds it), under transformers 5.19.0.

For each variant (``VARIANTS``: full-attention layers made causal by ``is_causal``; sliding-window
layers, causal by default; sliding-window layers made bidirectional by ``is_causal: false``, with a
window shorter than the block; a full-attention layer before a sliding-window one), z-lab's
``DFlashDraftModel`` is built on a tiny Qwen3 config in z-lab's layout (``dflash_config`` with taps
numbered by decoder layer and the mask token; block slot 0 holds the anchor and drafts nothing)
with seeded random weights (norms included), and its draft layers are saved as z-lab publishes
them, without the target's embedding or head (``tests/fixtures/tiny_zlab/<variant>/``). Then, as
``dflash_generate`` drafts a block at anchor ``a``, the model runs on random tapped features of
positions ``0 .. a - 1`` and the block ``[ids[a], MASK, MASK, MASK]`` at positions ``a .. a + 3``,
and ``tests/goldens/tiny_zlab.npz`` keeps the inputs and, for each anchor, the hidden states and
logits (through the target's tied embedding, ``compute_logits``) of the three drafting slots.

Usage: ``python scripts/make_zlab_goldens.py --dflash /path/to/z-lab/dflash``
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import numpy as np

# The same tiny Qwen3 target as the DeepSpec goldens, and the same seeded random weights.
from make_deepspec_goldens import TARGET, randomize

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "tiny_zlab"
GOLDEN = REPO / "tests" / "goldens" / "tiny_zlab.npz"
TAPS = [0, 2]  # z-lab numbers taps by decoder layer: its features are hidden_states[id + 1]
BLOCK_SIZE, MASK_TOKEN_ID = 4, 3
SEQUENCE = 24
ANCHORS = [2, 7, 12, 19]  # the later ones past every variant's window
# (layer_types, sliding_window, top-level is_causal: None leaves it out of the config)
VARIANTS = {
    "causal": (["full_attention", "full_attention"], None, True),
    "sliding": (["sliding_attention", "sliding_attention"], 6, None),
    "sliding_bidirectional": (["sliding_attention", "sliding_attention"], 3, False),
    "mixed": (["full_attention", "sliding_attention"], 6, None),
}


def make(name: str, seed: int) -> dict[str, np.ndarray]:
    import torch
    from dflash.model import DFlashDraftModel
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    kinds, window, is_causal = VARIANTS[name]
    # Qwen3Config keeps a sliding window only with use_sliding_window (else None: no window at all).
    sliding = dict(use_sliding_window=window is not None, sliding_window=window)
    layers = {**TARGET, "num_hidden_layers": len(kinds), "layer_types": kinds, **sliding}
    config = {**Qwen3Config(**layers).to_dict(), "architectures": ["DFlashDraftModel"], "block_size": BLOCK_SIZE,
              "num_target_layers": TARGET["num_hidden_layers"],
              "dflash_config": {"target_layer_ids": TAPS, "mask_token_id": MASK_TOKEN_ID}}
    if is_causal is not None:
        config["is_causal"] = is_causal
    torch.manual_seed(seed)
    model = DFlashDraftModel(Qwen3Config(**config)).eval()
    assert [layer.self_attn.sliding_window for layer in model.layers] == [
        window if kind == "sliding_attention" else None for kind in kinds]
    width = TARGET["hidden_size"]
    embedding = 0.2 * torch.randn(TARGET["vocab_size"], width)
    randomize(model)
    out = FIXTURES / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))

    features = torch.randn(SEQUENCE, len(TAPS) * width)
    ids = torch.randint(4, TARGET["vocab_size"], (SEQUENCE,))
    head = torch.nn.Linear(width, TARGET["vocab_size"], bias=False)
    hidden, logits = [], []
    with torch.no_grad():
        head.weight.copy_(embedding)  # the target's tied head
        for anchor in ANCHORS:
            block = torch.full((BLOCK_SIZE,), MASK_TOKEN_ID)
            block[0] = ids[anchor]
            drafted = model(target_hidden=features[None, :anchor], noise_embedding=embedding[block][None],
                            position_ids=torch.arange(anchor + BLOCK_SIZE)[None])[:, 1:]
            hidden.append(drafted[0])
            logits.append(model.compute_logits(drafted, head)[0])
    return {"embedding": embedding.numpy(), "features": features.numpy(), "input_ids": ids.numpy(),
            "anchors": np.asarray(ANCHORS), "hidden": torch.stack(hidden).numpy(),
            "logits": torch.stack(logits).numpy()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dflash", type=Path, required=True, help="a checkout of z-lab/dflash")
    args = parser.parse_args()
    sys.path.insert(0, str(args.dflash))
    arrays = {}
    for name in VARIANTS:
        seed = zlib.crc32(name.encode())  # each variant's own: adding one leaves the others' files as they were
        arrays |= {f"{name}/{key}": value for key, value in make(name, seed).items()}
    np.savez_compressed(GOLDEN, **arrays)
    print(json.dumps({name: sorted(p.name for p in (FIXTURES / name).iterdir()) for name in VARIANTS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
