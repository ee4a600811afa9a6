"""Pallas kernels for the hot loop (Mosaic TPU; Mosaic GPU / Triton on GPU).

Each kernel lives in ``pallas_kernels/<kernel>/`` with ``reference.py`` (the pure-JAX semantics: the
test oracle and the CPU path), ``tpu.py`` and/or ``gpu.py`` (the Pallas bodies, tested on CPU in
interpret mode), and ``dispatch.py`` picks one per backend, never silently. No kernel has landed
yet: every code path currently runs the pure-JAX implementation in ``dspark_jax``.
"""
