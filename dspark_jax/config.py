"""Frozen configuration dataclasses, validated on construction.

Every config refuses what it cannot honour with a ``ValueError`` that names the field, so a
mistake surfaces when the config is built, not as a shape error deep inside XLA.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen3")


def as_int(value, name: str, expected: str = "an int") -> int:
    """``value`` as a Python int: an int or a numpy integer, never a bool, a float or a str, which
    ``int()`` would silently truncate or parse. ``expected`` says what the error asks for."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be {expected}, got {value!r}")


def read_json(path, default: dict | None = None) -> dict:
    """The JSON object in the file ``path`` (``default`` where there is no such file, if given):
    a ``ValueError`` naming the file when it is not JSON or not an object."""
    path = Path(path)
    if default is not None and not path.exists():
        return default
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not the object expected")
    return value


def partial_path(path: Path) -> Path:
    """A temporary name beside ``path`` for writing it before renaming it into place: this
    process's own (pid and a random token), so that two writers of one file never write into
    each other's partial file; the last rename wins whole."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_json(path, value, **dumps_options) -> Path:
    """Write ``value`` as JSON to ``path`` whole or not at all (a temporary file renamed over it):
    a process killed mid-write leaves the earlier file, never half of a new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        partial.write_text(json.dumps(value, **dumps_options) + "\n")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    return path


def output_file(path, what: str) -> Path:
    """``path`` checked as a file ``write_json`` can write, before the work that fills it (minutes,
    often) rather than after: not a directory, in a folder that exists (created here) and that
    this process can write. ``what`` names the file in the errors."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: give {what} a file name (e.g. {path / 'result.json'})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cannot create the folder of {path}: {error.strerror}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {what} into {path.parent}")
    return path


def as_ints(values, name: str) -> tuple[int, ...]:
    """A collection of ints (a list, tuple, set or integer array), each checked by ``as_int``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a collection of ints, got {type(values).__name__} {values!r}")
    return tuple(as_int(value, f"every entry of {name}") for value in values)


def check_tap_layers(tap_layers, num_layers: int) -> tuple[int, ...]:
    """Validate decoder-layer ids whose raw outputs a forward returns (spec §1.2). Strictly
    ascending: the forward concatenates them in layer order, the order drafters are trained on,
    so another order (or a repeat) would not be the taps asked for."""
    taps = ascending_taps(tap_layers)
    bad = [i for i in taps if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"tap layer ids {bad} are outside the target's decoder layers 0..{num_layers - 1}")
    return taps


def ascending_taps(tap_layers) -> tuple[int, ...]:
    """Tap layer ids as ints, refused unless strictly ascending (``check_tap_layers``)."""
    return ascending_ids(tap_layers, "tap_layers", "tap layer ids")


def ascending_ids(values, name: str, what: str | None = None) -> tuple[int, ...]:
    """Layer ids as ints, refused unless strictly ascending (a repeat, or another order, is not
    what the ids describe)."""
    ids = as_ints(values, name)
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"{what or name} must be strictly ascending, got {list(ids)}")
    return ids


def check_context_taps(tap_layers, num_layers: int) -> tuple[int, ...]:
    """``check_tap_layers`` for the layers a drafter reads its context from, which never include
    the target's final layer: its output is the LM head's input, not a context feature (spec §1.2;
    the target cache stores it apart, as ``hidden``)."""
    taps = check_tap_layers(tap_layers, num_layers)
    if num_layers - 1 in taps:
        raise ValueError(f"tap layer {num_layers - 1} is the target's final layer (its features are not what "
                         "a drafter is trained on; spec §1.2)")
    return taps


def from_mapping(cls, values: Mapping[str, Any], what: str):
    """Build ``cls`` from a mapping, refusing keys the dataclass does not know."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {what} keys: {unknown}; known keys: {sorted(known)}")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3`` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A Llama-family decoder: SmolLM2, Llama 3 and Qwen3 (``qk_norm=True``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    architecture: str = "llama"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TargetConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        if isinstance(self.rope_scaling, Mapping):
            # Accept a plain dict (e.g. from JSON) but store the validated dataclass.
            object.__setattr__(
                self, "rope_scaling", from_mapping(RopeScaling, self.rope_scaling, "rope_scaling")
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TargetConfig:
        return from_mapping(cls, values, "TargetConfig")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_tap_layers(self, tap_layers: tuple[int, ...]) -> tuple[int, ...]:
        """``check_tap_layers`` for this target's layers."""
        return check_tap_layers(tap_layers, self.num_layers)


MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How logits become tokens. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0`` and ``top_p == 1.0`` disable those filters. Per-request values are passed to
    the decoders as arrays built from one ``SamplingConfig`` per request.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # Below MIN_TEMPERATURE, logits / T overflows float32 for large logits (NaN probabilities);
        # the reference treats such temperatures as greedy, which is 0 here.
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                             f"got {self.temperature}")
        top_k_range = "an int in [0, 2**31) (0 disables it)"
        object.__setattr__(self, "top_k", as_int(self.top_k, "top_k", top_k_range))  # numpy ints too
        if not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be {top_k_range}, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        """``greedy``, or e.g. ``T=0.7 top-k 20 top-p 0.8`` (the filters only when on)."""
        if self.greedy:
            return "greedy"
        return " ".join([f"T={self.temperature:g}"] + ([f"top-k {self.top_k}"] if self.top_k else [])
                        + ([f"top-p {self.top_p:g}"] if self.top_p < 1.0 else []))


MARKOV_HEADS = ("none", "vanilla", "gated", "rnn")
MARKOV_W1_ROWS = ("target", "draft")
DRAFTER_KINDS = ("dspark", "dflash", "eagle3")
# The fields that make a drafter DFlash or EAGLE-3 as DeepSpec runs them: no Markov head, no
# confidence head, cross-entropy alone (the classmethods below, and the checkpoint readers).
_WITHOUT_HEADS = dict(markov_head="none", confidence_head=False, confidence_with_markov=False, ce_weight=1.0,
                      tv_weight=0.0, confidence_weight=0.0)
DFLASH_FIELDS = dict(kind="dflash", **_WITHOUT_HEADS)
EAGLE3_FIELDS = dict(kind="eagle3", **_WITHOUT_HEADS)
# How an EAGLE-3 drafter RMS-normalises the tapped features before ``fc``: not at all, with one norm
# over their concatenation (speculators' ``norm_before_fc``), or one per tapped layer (``fc_norm``).
EAGLE3_FEATURE_NORMS = ("none", "joint", "per_layer")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A drafter for one target (spec §1–§4, §8).

    ``backbone`` holds the draft layers' dimensions: a copy of the target's config with its own
    ``num_layers`` (every other hyper-parameter is the target's, as in DeepSpec). Loss fields
    follow the reference code where paper and code disagree: position weights decay as
    ``exp(-s / position_decay)`` with 4.0 (paper: ``exp(-(k-1)/γ)``), and the distribution term is
    the L1 distance ``‖p_d − p_t‖₁`` (``tv_half=True`` gives the paper's ½‖·‖₁).
    """

    backbone: TargetConfig
    tap_layers: tuple[int, ...]
    mask_token_id: int
    kind: str = "dspark"
    block_size: int = 7  # γ: draft tokens proposed per round
    # Which block slot drafts the token after the anchor: the anchor's own (True: DeepSpec's and
    # DSpark's), or the next (False: a slot before the γ drafting ones drafts nothing, z-lab
    # DFlash's convention, speculators' ``sample_from_anchor`` false).
    draft_from_anchor: bool = True
    markov_head: str = "vanilla"
    markov_rank: int = 256
    # Rows of the Markov W1 table: "target" (one per target token, as DeepSpec) or "draft" (one per
    # draft-vocabulary token plus one shared by all others), which makes a wide rank cost N·r, not V·r.
    markov_w1_rows: str = "target"
    confidence_head: bool = True
    confidence_with_markov: bool = True
    confidence_bias: bool = True
    # Context positions a block sees; for EAGLE-3, positions a query sees, its own included (None: all).
    sliding_window: int | None = None
    # A block's slots attend to the slots before them and themselves only, not the whole block:
    # speculators' sliding-window DSpark and DFlash layers (its trainer's default), which vLLM
    # runs causally too. False: bidirectional within the block (DeepSpec, DFlash).
    block_causal: bool = False
    # Draft layers that attend as if neither of the two above were set: all context, the whole
    # block (speculators' ``--full-attention-indices`` among sliding-window layers).
    full_attention_layers: tuple[int, ...] = ()
    # Where a block drafter's sliding window is counted from. False: the block's anchor (the
    # ``sliding_window`` context positions before it, speculators' training mask). True: each
    # slot's own position p, itself included (positions p - sliding_window + 1 .. p, the block's
    # slots among them), as z-lab DFlash and vLLM run sliding-window layers.
    window_per_slot: bool = False
    draft_vocab_size: int | None = None  # reduced LM head over the top-N target tokens
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    position_decay: float = 4.0
    tv_half: bool = False
    ttt_step_decay: float = 0.8  # EAGLE-3 training-time-test step weight
    # EAGLE-3 variants speculators trains (all off: EAGLE-3 as published). The features' norm before
    # fc (EAGLE3_FEATURE_NORMS); the layer's residual stream starting from the normed hidden state
    # (``norm_before_residual``) instead of the raw one; the final norm's output serving as both the
    # head's input and the next step's hidden state (``norm_output``, EAGLE 3.1).
    eagle3_feature_norm: str = "none"
    eagle3_norm_before_residual: bool = False
    eagle3_norm_output: bool = False

    def __post_init__(self):
        if isinstance(self.backbone, Mapping):
            object.__setattr__(self, "backbone", TargetConfig.from_dict(self.backbone))
        object.__setattr__(self, "tap_layers", ascending_taps(self.tap_layers))
        object.__setattr__(self, "full_attention_layers", ascending_ids(self.full_attention_layers,
                                                                        "full_attention_layers"))
        # Exact types, as from a config.json a person may have edited: a float γ or a "false"
        # string would pass the range checks below and fail (or silently mean True) later.
        for name in ("mask_token_id", "block_size", "markov_rank"):
            object.__setattr__(self, name, as_int(getattr(self, name), name))
        for name in ("sliding_window", "draft_vocab_size"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_int(getattr(self, name), name, "an int or None"))
        for name in ("confidence_head", "confidence_with_markov", "confidence_bias", "tv_half", "draft_from_anchor",
                     "block_causal", "window_per_slot", "eagle3_norm_before_residual", "eagle3_norm_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("ce_weight", "tv_weight", "confidence_weight", "position_decay", "ttt_step_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.markov_head not in MARKOV_HEADS:
            raise ValueError(f"markov_head must be one of {MARKOV_HEADS}, got {self.markov_head!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size (γ) must be >= 1, got {self.block_size}")
        if self.markov_head != "none" and self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1 for a {self.markov_head} head")
        if self.markov_w1_rows not in MARKOV_W1_ROWS:
            raise ValueError(f"markov_w1_rows must be one of {MARKOV_W1_ROWS}, got {self.markov_w1_rows!r}")
        if self.markov_w1_rows == "draft" and (self.markov_head == "none" or self.draft_vocab_size is None):
            raise ValueError("markov_w1_rows='draft' needs a Markov head and a draft_vocab_size (its rows are "
                             "the draft vocabulary's)")
        if self.confidence_head and self.confidence_with_markov and self.markov_head == "none":
            raise ValueError("confidence_with_markov needs a Markov head (its W1 embedding)")
        if not self.tap_layers:
            raise ValueError("a drafter needs at least one tapped target layer")
        if not 0 <= self.mask_token_id < self.backbone.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.backbone.vocab_size})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.full_attention_layers:
            if self.sliding_window is None and not self.block_causal:
                raise ValueError("full_attention_layers exempt layers from sliding_window and block_causal; "
                                 "neither is set")
            outside = [i for i in self.full_attention_layers if not 0 <= i < self.backbone.num_layers]
            if outside:
                raise ValueError(f"full_attention_layers {outside} are outside the drafter's layers "
                                 f"0..{self.backbone.num_layers - 1}")
        if self.window_per_slot and self.sliding_window is None:
            raise ValueError("window_per_slot says where the sliding window is counted from; sliding_window is not set")
        block_options = self._changed(draft_from_anchor=True, block_causal=False, window_per_slot=False)
        if block_options and self.kind == "eagle3":
            raise ValueError(f"{', '.join(f'{name}={getattr(self, name)}' for name in block_options)} shape a block "
                             "drafter's block (dspark, dflash); the EAGLE-3 drafter drafts step by step")
        if self.eagle3_feature_norm not in EAGLE3_FEATURE_NORMS:
            raise ValueError(f"eagle3_feature_norm must be one of {EAGLE3_FEATURE_NORMS}, got {self.eagle3_feature_norm!r}")
        eagle3_options = self._changed(eagle3_feature_norm="none", eagle3_norm_before_residual=False,
                                       eagle3_norm_output=False)
        if eagle3_options and self.kind != "eagle3":
            raise ValueError(f"{', '.join(eagle3_options)} shape an EAGLE-3 drafter's layer, not a {self.kind} one")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.backbone.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in (0, {self.backbone.vocab_size}], got {self.draft_vocab_size}"
            )
        for name in ("ce_weight", "tv_weight", "confidence_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.position_decay <= 0:
            raise ValueError(f"position_decay must be > 0, got {self.position_decay}")

    def _changed(self, **defaults) -> list[str]:
        """The fields among ``defaults`` set to something other than their default."""
        return [name for name, default in defaults.items() if getattr(self, name) != default]

    def layer_window(self, layer: int) -> int | None:
        """Draft layer ``layer``'s sliding window (None: it sees every position)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def layer_block_causal(self, layer: int) -> bool:
        """Whether draft layer ``layer``'s block slots see only the slots up to their own."""
        return self.block_causal and layer not in self.full_attention_layers

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def block_slots(self) -> int:
        """Slots of a draft block: γ, and one more when the anchor's slot drafts nothing."""
        return self.block_size + (0 if self.draft_from_anchor else 1)

    @property
    def context_size(self) -> int:
        """Width of the concatenated tapped target features (m·d)."""
        return len(self.tap_layers) * self.backbone.hidden_size

    def check_target(self, target: TargetConfig) -> None:
        """Refuse a target this drafter cannot serve, naming every mismatch. Only the width and
        the vocabulary are shared (the frozen embedding and LM head come from the target); the
        drafter's attention keeps its own heads and cache, so its head counts may differ."""
        problems = []
        for name in ("hidden_size", "vocab_size"):
            mine, theirs = getattr(self.backbone, name), getattr(target, name)
            if mine != theirs:
                problems.append(f"{name}: drafter {mine}, target {theirs}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target vocabulary")
        try:
            check_context_taps(self.tap_layers, target.num_layers)  # a protocol target's cfg need not be a TargetConfig
        except ValueError as error:
            problems.append(str(error))
        if problems:
            raise ValueError("drafter does not fit the target: " + "; ".join(problems))

    @classmethod
    def for_target(cls, target: TargetConfig, *, num_layers: int, tap_layers, mask_token_id: int,
                   qk_norm: bool | None = None, **kw):
        """A drafter whose layers copy the target's dimensions (DeepSpec's deep copy + overrides).
        Its attention RMS-normalises q and k per head where the target's does (as DeepSpec's do,
        for Qwen3 and Gemma 4 targets); ``qk_norm=True`` adds the norms for a target without them,
        which on SmolLM2 trained no better (``docs/TRAINING.md``, "Checked against DeepSpec's code")."""
        qk_norm = target.qk_norm if qk_norm is None else qk_norm
        backbone = dataclasses.replace(target, num_layers=num_layers, qk_norm=qk_norm)
        cfg = cls(backbone=backbone, tap_layers=tuple(tap_layers), mask_token_id=mask_token_id, **kw)
        cfg.check_target(target)
        return cfg

    @classmethod
    def dflash(cls, target: TargetConfig, **kw):
        """DFlash as DeepSpec runs it: same backbone, no sequential/confidence head, CE only."""
        return cls.for_target(target, **{**DFLASH_FIELDS, **kw})

    @classmethod
    def eagle3(cls, target: TargetConfig, **kw):
        """The EAGLE-3-style autoregressive baseline: one layer unless ``num_layers`` says more,
        γ training-time-test steps."""
        return cls.for_target(target, **{**EAGLE3_FIELDS, "num_layers": 1, **kw})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DrafterConfig:
        return from_mapping(cls, values, "DrafterConfig")
