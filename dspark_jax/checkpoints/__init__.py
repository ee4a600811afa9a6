"""Checkpoints: targets (the embedded GGUF, GGUF files, HF directories) and drafters."""

from __future__ import annotations

import os


def save_safetensors(tensors, path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.numpy.save_file``, leaving the file readable as the process's umask allows:
    safetensors 0.8 writes through a temporary file created 0600 (safetensors issue #782), which
    would keep a saved model from a teammate, a container user or a serving process."""
    import safetensors.numpy

    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def load_target(checkpoint: str | os.PathLike | None, dtype="float32"):
    """``(target, tokenizer)``: the embedded SmolLM2 target for None, else a GGUF file or an HF
    checkpoint directory (its tokenizer read first, so that a missing one fails fast), with its
    weights in ``dtype``."""
    from pathlib import Path

    if checkpoint is None:
        from dspark_jax.checkpoints.gguf import load_embedded_target

        return load_embedded_target(dtype)
    path = Path(checkpoint)
    if path.is_file() and path.suffix == ".gguf":
        from dspark_jax.checkpoints.gguf import load_gguf

        return load_gguf(path, dtype)
    if path.is_dir():
        from dspark_jax.checkpoints.hf import load_hf_checkpoint
        from dspark_jax.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_directory(path)
        return load_hf_checkpoint(path, dtype), tokenizer
    raise ValueError(f"a target checkpoint is a .gguf file or an HF checkpoint directory, got {str(checkpoint)!r}")
