"""Produce the speculators reference goldens that ``tests/test_speculators.py`` checks in CI.

speculators (``vllm-project/speculators``: vLLM's drafter training library, whose checkpoints vLLM
serves) trains DSpark drafters as ``DSparkDraftModel`` (and DFlash and EAGLE-3 ones). This script needs it and its torch and
transformers, best in a venv of their own (speculators pins transformers 5)::

    python -m venv /tmp/specvenv
    /tmp/specvenv/bin/pip install torch==2.13.0 "transformers>=5,<=5.19" pydantic pydantic-settings loguru \\
        safetensors numpy rich typer click tqdm openai datasets hs-connectors
    /tmp/specvenv/bin/pip install --no-deps speculators==0.9.0
    /tmp/specvenv/bin/python scripts/make_speculators_goldens.py

CI needs none of them: it reads what this script wrote.

It also writes a tiny checkpoint in z-lab DFlash's layout (``tests/fixtures/tiny_zlab_dflash/``:
``DFlashDraftModel``, ``dflash_config``, taps numbered by decoder layer), has speculators' own
``DFlashConverter`` convert it against a tiny verifier transformers saves, and keeps what the
converted drafter computes (``zlab/...`` in the goldens).

For each variant (a gated Markov head over a reduced draft vocabulary, with a confidence head on
its features; an RNN head with a confidence head on the hidden state alone; a vanilla head with
no confidence head; a gated head whose block's slot 0 drafts nothing, and a DFlash drafter so,
over a reduced vocabulary: z-lab DFlash's convention; and ``SLIDING_VARIANTS``, with sliding-window
layers), speculators' config class describes a drafter of a tiny Qwen3 target, its
``DSparkDraftModel`` or ``DFlashDraftModel`` is built on it with random weights (norms
included; seeded by the variant's name) and saved with
``save_pretrained`` (``tests/fixtures/tiny_speculators/<variant>/``: the real format, without the
target's embedding, as speculators saves it, and without the copy of speculators' config
source it writes beside). Then its training forward runs on random tapped
features and tokens, and ``tests/goldens/tiny_speculators.npz`` keeps the inputs and what it
computed for each anchored block: the hidden states, and the Markov-corrected and confidence
logits speculators' loss receives (captured from its own ``forward``), with the target's
embedding the drafter was built with.

EAGLE-3 drafters (``EAGLE3_VARIANTS``: ``Eagle3DraftModel``, saved with the copy of the target's
embedding it keeps) get the logits of each training-time-test step of its training forward,
captured at its ``lm_head``. So do EAGLE-3 checkpoints in the layout of the EAGLE authors and
SpecForge (``EAGLE_VARIANTS``, ``tests/fixtures/tiny_eagle/``: ``LlamaForCausalLMEagle3``), once
speculators' own ``Eagle3Converter`` has converted them against a tiny verifier (``eagle/...``
in the goldens).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import numpy as np

# Seeded random weights, norms around 1, as the DeepSpec goldens draw them.
from make_deepspec_goldens import randomize as randomize_parameters

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "tiny_speculators"
GOLDEN = REPO / "tests" / "goldens" / "tiny_speculators.npz"
ZLAB_FIXTURE = REPO / "tests" / "fixtures" / "tiny_zlab_dflash"
TARGET = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
              tie_word_embeddings=True)
TARGET_LAYERS = 4
DRAFT_LAYERS = 2
# speculators numbers the target's hidden states as transformers does: 0 is the embedding output,
# i the output of decoder layer i - 1.
AUX_LAYER_IDS = [1, 3]
COMMON = dict(block_size=4, mask_token_id=3, aux_hidden_state_layer_ids=AUX_LAYER_IDS)
VARIANTS = {
    "gated": dict(markov_rank=8, markov_head_type="gated", enable_confidence_head=True,
                  confidence_head_with_markov=True, draft_vocab_size=61),
    "rnn": dict(markov_rank=8, markov_head_type="rnn", enable_confidence_head=True,
                confidence_head_with_markov=False, draft_vocab_size=97),
    "vanilla": dict(markov_rank=8, markov_head_type="vanilla", enable_confidence_head=False,
                    confidence_head_with_markov=False, draft_vocab_size=97),
    # Slot 0 drafts nothing (z-lab DFlash's convention): a DSpark drafter so, and a DFlash one.
    "gated_after_anchor": dict(markov_rank=8, markov_head_type="gated", enable_confidence_head=True,
                               confidence_head_with_markov=True, draft_vocab_size=97, sample_from_anchor=False),
    "dflash": dict(draft_vocab_size=61, sample_from_anchor=False),
    "zlab": dict(draft_vocab_size=97, sample_from_anchor=False),  # the drafter of the z-lab checkpoint
}
# Block drafters whose layers have sliding windows of 8 positions, shorter than the sequence: all
# of them (speculators' trainer's default) in a DSpark one, causal within its block (the default),
# and in a DFlash one whose block stays bidirectional (``sliding_window_non_causal``); the second
# of a DSpark one's two (its first a full-attention one: ``--full-attention-indices 0``).
SLIDING_VARIANTS = {
    "sliding": dict(markov_rank=8, markov_head_type="gated", enable_confidence_head=True,
                    confidence_head_with_markov=True, draft_vocab_size=97, sliding_window=8),
    "dflash_sliding": dict(draft_vocab_size=61, sample_from_anchor=False, sliding_window=8,
                           sliding_window_non_causal=True),
    "mixed_sliding": dict(markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True,
                          confidence_head_with_markov=False, draft_vocab_size=97, sliding_window=8,
                          layer_types=["full_attention", "sliding_attention"]),
}
SEQUENCE = 24
ANCHORS = 3
# EAGLE-3 drafters (Eagle3DraftModel): one draft layer, 3 TTT steps. "eagle3" is EAGLE-3 as
# published (Qwen3 layer, reduced vocabulary); "eagle3_trained" what speculators' trainer makes
# by default (Llama layer, the norms before the residual and fc and on the output, an 8-position
# sliding window, here shorter than the sequence); "eagle3_fc_norm" a norm per tapped layer.
EAGLE3_VARIANTS = {
    "eagle3": dict(arch="qwen3", draft_vocab_size=61),
    "eagle3_trained": dict(arch="llama", draft_vocab_size=97, norm_before_residual=True, norm_before_fc=True,
                           norm_output=True, sliding_window=8),
    "eagle3_fc_norm": dict(arch="qwen3", draft_vocab_size=61, fc_norm=True),
    # Two layers, as vLLM also serves them: the second a plain Qwen3 decoder layer; both windowed,
    # or the second a full-attention one.
    "eagle3_two_layers": dict(arch="qwen3", num_layers=2, draft_vocab_size=61, norm_before_residual=True,
                              norm_output=True, sliding_window=8),
    "eagle3_mixed": dict(arch="qwen3", num_layers=2, draft_vocab_size=61, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
}
TTT_STEPS = 3
# EAGLE-3 drafters in the layout of the EAGLE authors and SpecForge (``midlayer.*`` tensors, the
# fields at the top level of a Llama config), which vLLM and SGLang serve as they are; speculators'
# own ``Eagle3Converter`` converts each (``tests/fixtures/tiny_eagle/<variant>``). ``layer_ids``
# are what the converter is told, in transformers' numbering (None: left to the target).
EAGLE_VARIANTS = {
    # SpecForge's export: a reduced vocabulary, the copy of the target's embedding, layer ids in
    # ``eagle_config`` counted by decoder layer as SpecForge and SGLang count them (a first id of
    # 1), and a Qwen config's window fields, which a Llama layer does not use.
    "specforge": dict(fields=dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=61,
                                  eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3],
                                                "use_aux_hidden_state": True},
                                  sliding_window=4, use_sliding_window=False),
                      embedding=True, layer_ids=[2, 3, 4]),
    # The EAGLE authors' training config (``LlamaForCausalLM`` with ``draft_vocab_size``, here over
    # every token) without layer ids or the embedding's copy.
    "authors": dict(fields=dict(architectures=["LlamaForCausalLM"], draft_vocab_size=97), embedding=False,
                    layer_ids=None),
    # EAGLE 3.1's fields as in SpecForge's config for it, read as vLLM reads them: a norm per
    # tapped layer and the normed output fed back; top-level layer ids in transformers' numbering.
    "eagle31": dict(fields=dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=61, fc_norm=True,
                                norm_output=True, eagle_aux_hidden_state_layer_ids=[2, 3, 4]),
                    embedding=True, layer_ids=[2, 3, 4]),
}
EAGLE_FIXTURES = REPO / "tests" / "fixtures" / "tiny_eagle"
EAGLE_TARGET_LAYERS = 8


def drafter(name: str, seed: int):
    """``(model, its speculators module, the target's embedding, the draft vocabulary's ids)``: the
    variant's drafter with seeded random weights (norms included, so that a skipped one shows)."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import core as dflash
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dspark import core as dspark
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    variant = dict({**VARIANTS, **SLIDING_VARIANTS}[name])
    algorithm, core, config_class = (("dflash", dflash, DFlashSpeculatorConfig) if "markov_rank" not in variant else
                                     ("dspark", dspark, DSparkSpeculatorConfig))
    window, kinds = variant.pop("sliding_window", None), variant.pop("layer_types", ["sliding_attention"] * DRAFT_LAYERS)
    sliding = {} if window is None else dict(sliding_window=window, use_sliding_window=True, layer_types=kinds)
    layer_config = Qwen3Config(**TARGET, num_hidden_layers=DRAFT_LAYERS, **sliding)
    layer_config._attn_implementation = "eager"
    verifier = VerifierConfig(name_or_path="tiny-qwen3", architectures=["Qwen3ForCausalLM"])
    drafts = COMMON["block_size"] - (0 if variant.get("sample_from_anchor", True) else 1)
    config = config_class(
        transformer_layer_config=layer_config, **COMMON, **variant,
        speculators_config=SpeculatorsConfig(
            algorithm=algorithm, default_proposal_method="greedy", verifier=verifier,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=drafts)]))
    torch.manual_seed(seed)
    model = (core.DFlashDraftModel if core is dflash else core.DSparkDraftModel)(config).eval()
    embedding, draft_ids = randomize(model, variant["draft_vocab_size"])
    return model, core, embedding, draft_ids


def computed(model, core, seed: int, embedding, draft_ids) -> dict:
    """What speculators' training forward computes for each anchored block of random tapped
    features and tokens: the inputs, the hidden states, and the Markov-corrected and confidence
    logits its loss receives (captured at its ``compute_metrics``)."""
    import torch
    from speculators.models.dspark import core as dspark

    width = TARGET["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(1, SEQUENCE, len(AUX_LAYER_IDS) * width, generator=generator)
    input_ids = torch.randint(4, TARGET["vocab_size"], (1, SEQUENCE), generator=generator)
    loss_mask = torch.ones(1, SEQUENCE, dtype=torch.long)
    loss_mask[:, :6] = 0  # the prompt: no anchors there
    captured = {}
    backbone_forward = model._backbone_forward

    def keep_backbone(*args, **kwargs):
        captured["backbone"] = result = backbone_forward(*args, **kwargs)
        return result

    def keep_metrics(logits, targets, *args, **kwargs):  # DSpark's: (..., confidence_logits, ...)
        captured["logits"] = logits
        captured["confidence"] = args[0] if core is dspark else None
        return torch.zeros(()), {}

    model._backbone_forward = keep_backbone
    core.compute_metrics = keep_metrics
    torch.manual_seed(seed + 2)  # the anchors speculators samples
    with torch.no_grad():
        model(hidden_states=features, input_ids=input_ids, loss_mask=loss_mask,
              verifier_last_hidden_states=torch.randn(1, SEQUENCE, width, generator=generator),
              document_ids=torch.zeros(1, SEQUENCE, dtype=torch.long), max_anchors=ANCHORS)
    hidden, _, _, _, block_indices = captured["backbone"]
    slots = COMMON["block_size"]
    # Every slot; where slot 0 drafts nothing, its outputs are kept too (speculators' loss masks them).
    result = {"features": features[0], "input_ids": input_ids[0], "anchors": block_indices[::slots],
              "embedding": embedding, "draft_ids": draft_ids, "hidden": hidden[0].view(ANCHORS, slots, width),
              "corrected_logits": captured["logits"][0].view(ANCHORS, slots, -1)}
    if captured["confidence"] is not None:
        result["confidence_logits"] = captured["confidence"][0].view(ANCHORS, slots)
    return {key: value.numpy() for key, value in result.items()}


def randomize(model, draft_vocab_size: int):
    """``(the target's embedding, the draft vocabulary's ids)``, drawn at random, and the model
    given seeded random weights (norms away from 1, so that a skipped one shows), that embedding,
    and its tied head's rows for the draft vocabulary (speculators' mapping: ``t2d`` a mask,
    ``d2t`` offsets, target id minus draft index)."""
    import torch

    vocab, width = TARGET["vocab_size"], TARGET["hidden_size"]
    embedding = 0.2 * torch.randn(vocab, width)
    draft_ids = torch.arange(vocab)
    if model.use_draft_vocab:
        draft_ids = torch.sort(torch.randperm(vocab)[:draft_vocab_size]).values
    if model.use_draft_vocab:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_ids] = True
        model.load_vocab_mappings(t2d, draft_ids - torch.arange(draft_vocab_size))
    randomize_parameters(model)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding)
        model.lm_head.weight.copy_(embedding[draft_ids])
        model.verifier_lm_head.weight.copy_(embedding[draft_ids])
    return embedding, draft_ids


def make_eagle3(name: str, seed: int) -> dict[str, np.ndarray]:
    """A speculators ``Eagle3DraftModel`` saved, and the logits of each TTT step of its training
    forward (captured at its ``lm_head``) on random tapped features and tokens, fed as its data
    pipeline aligns them (``shift_batch``: features of position t with token t + 1)."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    variant = dict(EAGLE3_VARIANTS[name])
    arch, window, depth = variant.pop("arch"), variant.pop("sliding_window", None), variant.pop("num_layers", 1)
    kinds = variant.pop("layer_types", ["sliding_attention"] * depth)
    layer_fields = dict(TARGET, num_hidden_layers=depth)
    if window is not None:
        layer_fields |= dict(sliding_window=window, use_sliding_window=True, layer_types=kinds)
    layer_config = (Qwen3Config if arch == "qwen3" else LlamaConfig)(**layer_fields)
    layer_config._attn_implementation = "eager"
    verifier = VerifierConfig(name_or_path="tiny-verifier", architectures=["Qwen3ForCausalLM"])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, eagle_aux_hidden_state_layer_ids=AUX_LAYER_IDS, **variant,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy", verifier=verifier,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)]))
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config).eval()
    embedding, draft_ids = randomize(model, variant["draft_vocab_size"])
    out = FIXTURES / name
    model.save_pretrained(out, safe_serialization=True)
    (out / "config.py").unlink()  # speculators' source, copied beside (see make)
    return eagle3_logits(model, seed, len(AUX_LAYER_IDS), embedding, draft_ids)


def eagle3_logits(model, seed: int, taps: int, embedding, draft_ids) -> dict[str, np.ndarray]:
    """The logits of each TTT step of an ``Eagle3DraftModel``'s training forward (captured at its
    ``lm_head``) on random tapped features and tokens, with the inputs."""
    import torch

    vocab, width = TARGET["vocab_size"], TARGET["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(1, SEQUENCE, taps * width, generator=generator).to(model.fc.weight.dtype)
    input_ids = torch.randint(4, vocab, (1, SEQUENCE), generator=generator)
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[0]))
    with torch.no_grad():
        model(hidden_states=features[:, :-1], input_ids=input_ids[:, 1:],
              document_ids=torch.zeros(1, SEQUENCE - 1, dtype=torch.long), ttt_steps=TTT_STEPS)
    assert len(logits) == TTT_STEPS
    result = {"features": features[0], "input_ids": input_ids[0], "embedding": embedding, "draft_ids": draft_ids,
              "logits": torch.stack(logits)}
    return {key: value.to(torch.float32 if value.is_floating_point() else value.dtype).numpy()
            for key, value in result.items()}


def make(name: str, seed: int) -> dict[str, np.ndarray]:
    model, core, embedding, draft_ids = drafter(name, seed)
    out = FIXTURES / name
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained also copies speculators' config source beside it (``auto_map``, for
    # transformers' remote code); it is their code, not the format, and nothing here reads it.
    (out / "config.py").unlink()
    return computed(model, core, seed, embedding, draft_ids)


def save_checkpoint(out: Path, config: dict, tensors: dict) -> None:
    """A checkpoint in another program's layout: its ``config.json`` and safetensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / "model.safetensors"))


def saved_verifier(scratch: str, verifier, embedding) -> str:
    """Where ``verifier`` (a tiny transformers target given ``embedding``) is saved for a
    converter, which reads its config and embedding."""
    import torch

    with torch.no_grad():
        verifier.model.embed_tokens.weight.copy_(embedding)
    verifier.save_pretrained(f"{scratch}/verifier")
    return f"{scratch}/verifier"


def make_zlab(seed: int) -> dict[str, np.ndarray]:
    """A z-lab DFlash checkpoint (its ``config.json`` layout, the draft layers' tensors without
    embedding or head), converted by speculators' own ``DFlashConverter`` against a tiny verifier
    saved by transformers; what the converted drafter computes is the golden."""
    import tempfile

    import torch
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.models.dflash import core as dflash
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model, _, embedding, draft_ids = drafter("zlab", seed)
    body = {k: v.contiguous() for k, v in model.state_dict().items()
            if k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}
    out = ZLAB_FIXTURE
    config = {**Qwen3Config(**TARGET, num_hidden_layers=DRAFT_LAYERS).to_dict(), "architectures": ["DFlashDraftModel"],
              "block_size": COMMON["block_size"], "num_target_layers": TARGET_LAYERS,
              # z-lab numbers taps by decoder layer (its features are hidden_states[id + 1])
              "dflash_config": {"target_layer_ids": [i - 1 for i in AUX_LAYER_IDS],
                                "mask_token_id": COMMON["mask_token_id"]}}
    save_checkpoint(out, config, body)
    with tempfile.TemporaryDirectory() as scratch:
        verifier = saved_verifier(scratch, Qwen3ForCausalLM(Qwen3Config(**TARGET, num_hidden_layers=TARGET_LAYERS)),
                                  embedding)
        DFlashConverter().convert(out, f"{scratch}/converted", base_model=verifier)
        converted_config = DFlashSpeculatorConfig.from_pretrained(f"{scratch}/converted")
        assert converted_config.aux_hidden_state_layer_ids == AUX_LAYER_IDS, converted_config
        converted_config.transformer_layer_config._attn_implementation = "eager"
        converted = dflash.DFlashDraftModel.from_pretrained(f"{scratch}/converted", config=converted_config).eval()
        for key, value in body.items():  # the converter copies the body as it is
            assert torch.equal(converted.state_dict()[key], value), key
        return computed(converted, dflash, seed, embedding, draft_ids)


def make_eagle(name: str, seed: int) -> dict[str, np.ndarray]:
    """A checkpoint in the EAGLE authors' and SpecForge's layout (``EAGLE_VARIANTS``), its weights
    random, converted by speculators' own ``Eagle3Converter`` against a tiny verifier saved by
    transformers; what the converted drafter computes is the golden."""
    import tempfile

    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    variant = EAGLE_VARIANTS[name]
    fields, taps = variant["fields"], 3
    vocab, draft_vocab = TARGET["vocab_size"], fields["draft_vocab_size"]
    # speculators' model of the same drafter gives the tensors their names and shapes.
    layer_config = LlamaConfig(**TARGET, num_hidden_layers=1)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, eagle_aux_hidden_state_layer_ids=[2, 3, 4], draft_vocab_size=draft_vocab,
        fc_norm=fields.get("fc_norm", False), speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="tiny-verifier", architectures=["LlamaForCausalLM"]),
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)]))
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    embedding, draft_ids = randomize(model, draft_vocab)
    tensors = {key.replace("layers.0.", "midlayer."): value.contiguous() for key, value in model.state_dict().items()
               if not key.startswith("verifier_") and (variant["embedding"] or key != "embed_tokens.weight")}
    if draft_vocab == vocab:  # the authors keep the maps over every token too
        tensors |= {"d2t": torch.zeros(vocab, dtype=torch.long), "t2d": torch.ones(vocab, dtype=torch.bool)}
    out = EAGLE_FIXTURES / name
    eagle_config = {**LlamaConfig(**dict(TARGET, tie_word_embeddings=False), num_hidden_layers=1).to_dict(), **fields}
    save_checkpoint(out, eagle_config, tensors)
    with tempfile.TemporaryDirectory() as scratch:
        # Deep enough that the taps a config without layer ids leaves to it are distinct (2, 4, 5).
        verifier = saved_verifier(
            scratch, LlamaForCausalLM(LlamaConfig(**TARGET, num_hidden_layers=EAGLE_TARGET_LAYERS)), embedding)
        Eagle3Converter().convert(out, f"{scratch}/converted", base_model=verifier, validate=False,
                                  norm_before_residual=fields.get("norm_before_residual", False),
                                  eagle_aux_hidden_state_layer_ids=variant["layer_ids"])
        converted_config = Eagle3SpeculatorConfig.from_pretrained(f"{scratch}/converted")
        converted_config.transformer_layer_config._attn_implementation = "eager"
        converted = Eagle3DraftModel.from_pretrained(f"{scratch}/converted", config=converted_config).eval()
        with torch.no_grad():
            if not variant["embedding"]:  # vLLM and SGLang embed with the target's where a drafter keeps no copy
                converted.embed_tokens.weight.copy_(embedding)
            # The converter (0.9.0) drops fc_norm.*: its legacy model has no such norms, so the
            # converted drafter would start them afresh. They are put back as the checkpoint has them.
            for key, value in tensors.items():
                if key.startswith("fc_norm."):
                    converted.get_parameter(key).copy_(value)
        state = converted.state_dict()
        for key, value in tensors.items():  # otherwise the converter copies the weights as they are
            if key in ("d2t", "t2d") and draft_vocab == vocab:
                assert key not in state  # over every token it keeps no maps, as vLLM reads none
                continue
            assert torch.equal(state[key.replace("midlayer.", "layers.0.")].to(value.dtype), value), key
        # In float64 (transformers' norms still normalise in float32): its float32 run rounds by up
        # to 1.9e-4 on the EAGLE 3.1 fields' random weights, more than the tests' 5e-5, where the
        # float64 one agrees with dspark-jax's float32 drafter to 2.8e-5 (1e-5 on the others).
        return eagle3_logits(converted.double(), seed, taps, embedding, draft_ids)


def main() -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"  # the tiny verifier is nowhere to download
    arrays = {}
    for name in [*VARIANTS, *EAGLE3_VARIANTS, *SLIDING_VARIANTS]:
        seed = zlib.crc32(name.encode())  # each variant's own: adding one leaves the others' files as they were
        outputs = (make_zlab(seed) if name == "zlab" else make_eagle3(name, seed) if name in EAGLE3_VARIANTS
                   else make(name, seed))
        arrays |= {f"{name}/{key}": value for key, value in outputs.items()}
    for name in EAGLE_VARIANTS:
        arrays |= {f"eagle/{name}/{key}": value for key, value in make_eagle(name, zlib.crc32(name.encode())).items()}
    np.savez_compressed(GOLDEN, **arrays)
    written = ({name: FIXTURES / name for name in [*VARIANTS, *EAGLE3_VARIANTS, *SLIDING_VARIANTS] if name != "zlab"}
               | {"zlab": ZLAB_FIXTURE} | {f"eagle/{name}": EAGLE_FIXTURES / name for name in EAGLE_VARIANTS})
    print(json.dumps({name: sorted(p.name for p in directory.iterdir()) for name, directory in written.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
