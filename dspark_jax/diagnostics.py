"""Diagnostics for the "no recompilation after warm-up" guarantee."""

from __future__ import annotations

import contextlib

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    count: int = 0


@contextlib.contextmanager
def count_compilations():
    """Count XLA backend compilations inside the block (``with ... as counter: counter.count``)."""
    counter = CompileCounter()

    def listener(event, duration_secs, **kwargs):
        if event == _BACKEND_COMPILE_EVENT:
            counter.count += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
