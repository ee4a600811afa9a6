"""Frozen configuration dataclasses, validated on construction.

Every config refuses what it cannot honour with a ``ValueError`` that names the field, so a
mistake surfaces when the config is built, not as a shape error deep inside XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ARCHITECTURES = ("llama", "qwen3")


def _from_mapping(cls, values: Mapping[str, Any], what: str):
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
                self, "rope_scaling", _from_mapping(RopeScaling, self.rope_scaling, "rope_scaling")
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TargetConfig:
        return _from_mapping(cls, values, "TargetConfig")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_tap_layers(self, tap_layers: tuple[int, ...]) -> tuple[int, ...]:
        """Validate decoder-layer ids whose raw outputs the forward returns (spec §1.2)."""
        taps = tuple(int(i) for i in tap_layers)
        bad = [i for i in taps if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"tap layer ids {bad} are outside the target's decoder layers 0..{self.num_layers - 1}"
            )
        if list(taps) != sorted(set(taps)):
            raise ValueError(f"tap layer ids must be strictly ascending, got {list(taps)}")
        return taps


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
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
