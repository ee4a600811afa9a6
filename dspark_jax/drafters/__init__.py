"""Trained drafters shipped inside the package, one directory each (``config.json`` +
``model.safetensors``, as written by :func:`dspark_jax.checkpoints.drafter.save_drafter`).

All three are for the embedded SmolLM2-135M-Instruct target:

- ``smollm2_135m_dspark``: DSpark (parallel block drafter + Markov head + confidence head);
- ``smollm2_135m_dflash``: the DFlash baseline (same backbone, no sequential/confidence head);
- ``smollm2_135m_eagle3``: the EAGLE-3-style autoregressive baseline.

A name is only usable once its directory exists (the drafters are trained separately and added
to the package when they are done); :func:`shipped_drafter_path` says so when one is missing.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = ("smollm2_135m_dspark", "smollm2_135m_dflash", "smollm2_135m_eagle3")
DEFAULT = "smollm2_135m_dspark"
FILES = ("config.json", "model.safetensors")
_ROOT = Path(__file__).resolve().parent


def is_shipped(name: str) -> bool:
    """Whether the shipped drafter ``name`` is present in this installation."""
    return name in SHIPPED and all((_ROOT / name / f).is_file() for f in FILES)


def shipped_drafter_path(name: str) -> Path:
    """The directory of a shipped drafter; a clear error for an unknown or not-yet-shipped one."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped drafter {name!r}; the shipped names are {', '.join(SHIPPED)}")
    path = _ROOT / name
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"shipped drafter {name!r} is not trained/shipped yet: {path} has no {' or '.join(missing)} "
            f"(the shipped names are {', '.join(SHIPPED)}; pass a checkpoint directory instead)"
        )
    return path


def resolve_drafter(spec: str) -> tuple[str, Path]:
    """``(name, directory)`` for a shipped drafter name or a checkpoint directory path.

    A shipped name wins over a same-named directory in the working directory (write ``./name``
    for that). The name of a path is its directory name.
    """
    if spec in SHIPPED:
        return spec, shipped_drafter_path(spec)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"drafter {spec!r} is neither a shipped drafter ({', '.join(SHIPPED)}) nor a directory"
        )
    return path.resolve().name, path
