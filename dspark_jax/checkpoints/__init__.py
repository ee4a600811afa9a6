"""Checkpoints: targets (the embedded GGUF, GGUF files, HF directories) and drafters."""

from __future__ import annotations

import os


def load_target(checkpoint: str | os.PathLike | None):
    """``(target, tokenizer)``: the embedded SmolLM2 target for None, else a GGUF file or an HF
    checkpoint directory (its tokenizer read first, so that a missing one fails fast)."""
    from pathlib import Path

    if checkpoint is None:
        from dspark_jax.checkpoints.gguf import load_embedded_target

        return load_embedded_target()
    path = Path(checkpoint)
    if path.is_file() and path.suffix == ".gguf":
        from dspark_jax.checkpoints.gguf import load_gguf

        return load_gguf(path)
    if path.is_dir():
        from dspark_jax.checkpoints.hf import load_hf_checkpoint
        from dspark_jax.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_directory(path)
        return load_hf_checkpoint(path), tokenizer
    raise ValueError(f"a target checkpoint is a .gguf file or an HF checkpoint directory, got {str(checkpoint)!r}")
