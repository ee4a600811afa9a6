"""Continuous batching: more requests than batch rows, a finished request's row taken by the next.

A decoder keeps one batch of ``rows`` in flight. ``Slots`` (host side) says which request each
row is decoding and which requests wait; when rows free up, the next waiting requests are
prefilled as a small batch of their own and their per-row state (target cache rows, drafter
context rows, anchor, PRNG keys, sampling parameters) is written into the freed rows by
``RowInserter``. Every request keeps its own PRNG stream and step counter, so what it generates
does not depend on when it joined or on its neighbours, except through a batch-wide verify
policy (threshold, scheduler), whose lengths weigh every row in flight, and through float
rounding (its prefill's shape depends on the requests it joined with; ``docs/EXACTNESS.md``).

Refill sizes are bucketed (a multiple of the mesh's data-parallel devices, doubling, up to
``rows``) so that only a few prefill shapes compile. With ``buckets`` the batch itself takes those
sizes: it runs at the smallest that holds the rows in flight, so a lightly loaded server pays for
one or two rows rather than ``rows``. When the rows in flight outgrow it or fit a smaller one, the
state is resized (``StateRows.take``: the rows kept move to the front, in order).

Requests may also arrive while the batch decodes (online serving, ``engine.load``): with
``arrivals``, a request waits for a row only from its arrival time on, requests join in order of
arrival, and a decoder with nothing in flight sleeps until the next one arrives.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

IDLE = -1


class Refill(NamedTuple):
    """Requests joining the batch: ``requests[i]`` takes row ``rows[i]``, prefilled as a batch of
    ``size`` (the requests, then padding). ``whole``: every row was idle, so ``size`` is the
    batch's and ``rows`` is ``0..len(requests)-1``; the prefilled state replaces the batch's.
    ``keep``: the batch is resized first (``Slots.resize``), ``None`` if not."""

    rows: np.ndarray
    requests: list[int]
    size: int
    whole: bool
    keep: np.ndarray | None = None


class Slots:
    """Which request each row decodes (``IDLE`` for none) and the requests still waiting.

    ``continuous=False`` refills only once every row is idle: fixed batches of ``rows``
    requests in order, each batch's composition independent of when its requests finish.

    ``buckets``: the batch has ``live`` rows, the smallest of ``sizes`` that holds the rows in
    flight (else always ``rows``); ``request_of`` has ``live`` entries.

    ``arrivals``: per request, the seconds after ``start`` (a ``clock()`` reading; default: when
    this object is made) at which it arrives (default: all at once). Requests are taken in order
    of arrival (ties in index order), each only once ``clock()`` has reached its arrival (a fixed
    batch then takes those that have, up to ``rows``); ``sleep`` waits for one (both replaceable
    for tests).
    """

    def __init__(self, num_requests: int, rows: int, devices: int = 1, *, continuous: bool = True,
                 arrivals: Collection[float] | None = None, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, buckets: bool = False, start: float | None = None):
        if rows < 1:
            raise ValueError(f"a batch needs at least one row, got {rows}")
        self.rows, self.continuous, self.buckets = rows, continuous, buckets
        self.request_of = np.full(0 if buckets else rows, IDLE, np.int64)
        arrival_s = np.zeros(num_requests) if arrivals is None else checked_arrivals(arrivals, num_requests)
        order = np.argsort(arrival_s, kind="stable")
        self.waiting = deque(int(i) for i in order)
        self._arrival_order_s = arrival_s[order]  # ascending; waiting = the last len(waiting) of them
        self.clock, self.sleep = clock, sleep
        self.start = clock() if start is None else start
        self.sizes = refill_sizes(rows, devices)

    @property
    def active(self) -> np.ndarray:
        return self.request_of != IDLE

    @property
    def live(self) -> int:
        """The rows the batch has now (``rows`` without ``buckets``)."""
        return self.request_of.size

    def release(self, row: int) -> None:
        self.request_of[row] = IDLE

    def bucket(self, count: int) -> int:
        """The smallest batch (or refill) size that holds ``count`` rows."""
        return next(s for s in self.sizes if s >= count)

    def _busy(self, held: Collection[int]) -> np.ndarray:
        busy = self.request_of != IDLE
        busy[list(held)] = True
        return np.flatnonzero(busy)

    def refill(self, held: Collection[int] = ()) -> Refill | None:
        """The next waiting requests for the idle rows, if it is time to refill. ``held``: idle
        rows not to refill yet (they count as busy). With ``buckets`` the batch grows to hold
        them (``Refill.keep``)."""
        busy = self._busy(held)
        room = (self.rows if self.buckets else self.live) - busy.size
        if not self.waiting or not room or (not self.continuous and busy.size):
            return None
        count = min(room, self.arrived())
        if not count:
            return None
        whole = not busy.size
        keep = None
        if whole:
            self.request_of = np.full(self.bucket(count) if self.buckets else self.rows, IDLE, np.int64)
        elif self.buckets and self.bucket(busy.size + count) != self.live:
            keep = self.resize(self.bucket(busy.size + count), held)
        if keep is None:
            idle = np.setdiff1d(np.flatnonzero(self.request_of == IDLE), list(held))
        else:  # the busy rows (held ones included) are first now
            idle = np.arange(busy.size, self.live)
        rows = idle[:count]
        requests = [self.waiting.popleft() for _ in range(count)]
        self.request_of[rows] = requests
        return Refill(rows, requests, self.live if whole else self.bucket(count), whole, keep)

    def shrink(self, held: Collection[int] = ()) -> np.ndarray | None:
        """With ``buckets``: resize to the smallest size holding the busy rows, if that is smaller
        (``resize``'s ``keep``); ``None`` if the batch stays (or is empty: the next refill
        replaces it)."""
        busy = self._busy(held)
        if not self.buckets or not busy.size or self.bucket(busy.size) == self.live:
            return None
        return self.resize(self.bucket(busy.size), held)

    def resize(self, live: int, held: Collection[int] = ()) -> np.ndarray:
        """Make the batch ``live`` rows, the busy ones (in flight or ``held``) first, in order:
        returns ``keep``, the old row each new row takes (``StateRows.take``; rows past the busy
        ones copy the first and are idle). A held row moves to its index in ``keep``."""
        busy = self._busy(held)
        keep = np.concatenate([busy, np.full(live - busy.size, busy[0] if busy.size else 0)]).astype(np.int32)
        self.request_of = np.concatenate([self.request_of[busy], np.full(live - busy.size, IDLE, np.int64)])
        return keep

    def arrived(self) -> int:
        """How many waiting requests have arrived."""
        taken = len(self._arrival_order_s) - len(self.waiting)
        return int(np.searchsorted(self._arrival_order_s, self.clock() - self.start, side="right")) - taken

    def wait_for_arrival(self) -> bool:
        """With no row in flight: sleep until the next waiting request arrives. False if none waits
        (the run is over)."""
        if not self.waiting:
            return False
        delay = self._arrival_order_s[-len(self.waiting)] - (self.clock() - self.start)
        if delay > 0:
            self.sleep(delay)
        return True


def refill_sizes(rows: int, devices: int = 1) -> list[int]:
    """The batch sizes refills are prefilled at: devices, 2 * devices, ... below ``rows``, then
    ``rows`` itself (what a warm-up compiles so that no refill compiles while serving)."""
    return [devices * 2**k for k in range(rows.bit_length()) if devices * 2**k < rows] + [rows]


def checked_arrivals(arrivals: Collection[float], num_requests: int) -> np.ndarray:
    """``arrivals`` as float seconds, one per request, each finite and >= 0 (or a ValueError)."""
    try:
        times = np.asarray(arrivals, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"arrivals must be numbers of seconds, one per request; got {arrivals!r}") from None
    if times.shape != (num_requests,):
        raise ValueError(f"arrivals: one time per request, so {num_requests}; got shape {times.shape}")
    bad = np.flatnonzero(~np.isfinite(times) | (times < 0))
    if bad.size:
        raise ValueError(f"arrivals are seconds after the start, finite and >= 0; request {bad[0]} has {times[bad[0]]}")
    return times


class Completions:
    """Each request's tokens so far and finish reason. ``emit`` adds a row's new tokens to its
    request (reported to ``on_tokens(index, new_tokens)``) and, once that request is done (a stop
    token, or its ``limits`` entry: its max_new_tokens), frees the row and reports it to
    ``on_finish(index, tokens, reason)``."""

    def __init__(self, slots: Slots, limits: Sequence[int], on_finish: Callable | None,
                 on_tokens: Callable | None = None):
        self.slots, self.limits, self.on_finish, self.on_tokens = slots, limits, on_finish, on_tokens
        self.tokens: list[list[int]] = [[] for _ in limits]
        self.reasons = ["length"] * len(limits)

    def emit(self, row: int, tokens, stopped: bool) -> None:
        """``tokens`` (ending in a stop token if ``stopped``) committed for row ``row``'s request."""
        request = int(self.slots.request_of[row])
        out, limit = self.tokens[request], self.limits[request]
        room = limit - len(out)
        added = [int(t) for t in tokens[:room]]
        out.extend(added)
        if added and self.on_tokens is not None:
            self.on_tokens(request, added)
        if stopped and len(tokens) <= room:
            self.reasons[request] = "stop"
        elif len(out) < limit:
            return
        self.slots.release(row)
        if self.on_finish is not None:
            self.on_finish(request, out, self.reasons[request])


def row_axes(make: Callable[[int], Any]) -> Any:
    """For each leaf of the pytree ``make(batch)``, the axis that holds the batch: the one whose
    size differs between batch 1 and batch 2 (a cache may keep layers first)."""
    one, two = jax.eval_shape(lambda: make(1)), jax.eval_shape(lambda: make(2))

    def axis(a, b):
        differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(differ) != 1:
            raise ValueError(f"cannot tell the batch axis of a state leaf: shape {a.shape} at batch 1, {b.shape} at 2")
        return differ[0]

    return jax.tree.map(axis, one, two)


def _insert_rows(batch_state, refill_state, dest_N, *, axes):
    def put(batch_leaf, refill_leaf, axis):
        # Padding rows of the refill carry an out-of-range destination: dropped.
        return batch_leaf.at[(slice(None),) * axis + (dest_N,)].set(refill_leaf, mode="drop")

    return jax.tree.map(put, batch_state, refill_state, axes)


def _take_rows(state, source_N, *, axes):
    return jax.tree.map(lambda leaf, axis: jnp.take(leaf, source_N, axis=axis), state, axes)


class StateRows:
    """Moves per-row state between batches: ``insert`` writes a refill's rows into the batch's
    (donated, in place), ``take`` builds a batch of other rows (a resize).

    ``make(batch)`` builds a state pytree of that batch size (only its shapes are used, to find
    each leaf's batch axis)."""

    def __init__(self, make: Callable[[int], Any]):
        axes = row_axes(make)
        self._insert = jax.jit(functools.partial(_insert_rows, axes=axes), donate_argnums=(0,))
        self._take = jax.jit(functools.partial(_take_rows, axes=axes))

    def insert(self, batch_state, refill_state, rows: np.ndarray, size: int, batch: int):
        """Refill row ``i < len(rows)`` goes to batch row ``rows[i]``; rows past that are padding.
        ``batch``: the batch state's rows."""
        dest = np.full(size, batch, np.int32)
        dest[: len(rows)] = rows
        return self._insert(batch_state, refill_state, dest)

    def take(self, state, keep: np.ndarray):
        """A batch of ``len(keep)`` rows, row ``i`` being ``state``'s row ``keep[i]``."""
        return self._take(state, np.asarray(keep, np.int32))

    def warm(self, state, batch: int, dummy: Callable[[int], Any], sizes: Sequence[int], batches: Sequence[int]):
        """Run (so compile) every refill of ``sizes`` into this ``batch``-row ``state`` and every
        resize from it to the other ``batches``; ``dummy(size)`` is a refill's state."""
        for size in sizes:
            if size <= batch:
                state = self.insert(state, dummy(size), np.arange(size), size, batch)
        for other in batches:
            if other != batch:
                self.take(state, np.zeros(other, np.int32))
        return state
