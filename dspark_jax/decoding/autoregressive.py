"""Target-only batched generation: the baseline DSpark is measured against.

Shapes are static per (batch slots, cache length, prefill bucket), so after the first call
nothing compiles again however many tokens are generated. Prompts of different lengths share
one right-padded prefill; each row then decodes at its own position. Finished rows are frozen
(their cache length stops moving) while the rest continue, or, with more prompts than
``batch_size`` rows, take the next prompt (continuous batching, ``decoding.slots``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dspark_jax.config import SamplingConfig, as_int, as_ints, check_tap_layers
from dspark_jax.decoding.rows import RowSplit, in_mesh_scope
from dspark_jax.decoding.slots import IDLE, Completions, Slots, StateRows, refill_sizes
from dspark_jax.decoding.target_protocol import SpeculativeTarget
from dspark_jax.sampling import SamplingParams, request_keys, sample, step_keys

CACHE_LEN_MULTIPLE = 128

# ``on_finish(request index, its tokens, finish reason)``: called as each request finishes.
FinishCallback = Callable[[int, list[int], str], None]
TokensCallback = Callable[[int, list[int]], None]  # (request index, its newly committed tokens)


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= n (and >= minimum): few distinct shapes, bounded padding."""
    size = minimum
    while size < n:
        size *= 2
    return size


def prompt_width(longest: int, max_len: int) -> int:
    """Columns of a prefill: the longest prompt's bucket, but no wider than the cache it is written
    into, which is sized to prompt + new tokens and can be narrower than the bucket (a 260-token
    prompt pads to 512 columns; with 8 new tokens its cache holds 384)."""
    return min(bucket(longest), max_len)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per request, a stop token included when one ended it
    finish_reasons: list[str]  # "stop" (EOS / stop id) or "length" (max_new_tokens)
    prefill_s: float  # prefill + first token
    decode_s: float  # every later step
    steps: int  # decode steps after prefill
    # With ``tap_layers`` (and max_new_tokens > 0): per request, the tapped layers' raw outputs at
    # every position of prompt + generated tokens, ``[len(prompt) + len(tokens), len(tap_layers) * d]``.
    taps: list[np.ndarray] | None = None
    rows_per_step: list[int] = dataclasses.field(default_factory=list)  # the batch's rows at each step

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens from the decode loop (excluding each request's first, from prefill) per second."""
        produced = sum(max(len(t) - 1, 0) for t in self.tokens)
        return produced / self.decode_s if self.decode_s > 0 else float("nan")


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    checked = []
    for i, prompt in enumerate(prompts):
        ids = list(as_ints(prompt, f"prompt {i} (token ids)"))
        if not ids:
            raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
        checked.append(ids)
    return checked


def cache_len(prompt_lens: Sequence[int], max_new_tokens: int, limit: int, slack: int = 0) -> int:
    """Cache slots for a batch: longest prompt + new tokens (+ verify slack), rounded up to 128."""
    need = max(prompt_lens) + max_new_tokens + slack
    if need > limit:
        raise ValueError(
            f"prompt ({max(prompt_lens)} tokens) + max_new_tokens ({max_new_tokens})"
            + (f" + verify slack ({slack})" if slack else "")
            + f" = {need} exceeds the model's max_position_embeddings ({limit})"
        )
    return min(-(-need // CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE, limit)


@dataclasses.dataclass
class Requests:
    """A validated batch of requests, with the right-padded prompt array for one prefill."""

    prompts: list[list[int]]
    lens: list[int]
    padded_BxP: np.ndarray  # int32, prompt length bucketed (few prefill shapes)
    params: SamplingParams
    keys_B: jax.Array
    limits: list[int]  # each request's max_new_tokens
    stop_ids: frozenset[int]

    @property
    def max_new_tokens(self) -> int:
        """The largest request's: what the cache is sized for."""
        return max(self.limits)

    @property
    def batch(self) -> int:
        return len(self.prompts)

    def pick(self, indices: Sequence[int], max_len: int) -> tuple[np.ndarray, list[int], SamplingParams, jax.Array]:
        """Requests ``indices`` (repeats allowed) as a batch of their own: right-padded prompts
        (``prompt_width`` columns for a ``max_len`` cache), lengths, sampling parameters and PRNG keys."""
        lens = [self.lens[i] for i in indices]
        index = np.asarray(indices)
        # Gathered on the host: indexing the device arrays would compile a gather per batch shape,
        # after any warm-up.
        picked = jax.tree.map(lambda x: jax.device_put(np.asarray(x)[index]), (self.params, self.keys_B))
        return self.padded_BxP[index, : prompt_width(max(lens), max_len)], lens, *picked

    def check_fits(self, max_len, slack: int) -> int:
        """``max_len``, a cache length given by hand, as an int that holds prompt + new tokens + slack."""
        max_len = as_int(max_len, "max_len")
        need = max(self.lens) + self.max_new_tokens + slack
        if need > max_len:
            raise ValueError(
                f"prompt of {max(self.lens)} tokens + max_new_tokens {self.max_new_tokens}"
                + (f" + verify slack {slack}" if slack else "")
                + f" does not fit the cache length {max_len}"
            )
        return max_len


def prepare_requests(
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    max_new_tokens: int,
    sampling: SamplingConfig | Sequence[SamplingConfig] | None,
    seeds: Sequence[int] | int,
    stop_ids: Iterable[int] = (),
) -> Requests:
    """Validate a generate() call's per-request arguments (shared by all decoders).

    ``max_new_tokens`` is one int >= 0 for all, or one int >= 1 per request; ``sampling`` one
    config for all or one per request (default greedy); ``seeds`` one int per request, or one int
    from which request ``i`` uses ``seed + i``; ``stop_ids`` any number of token ids. Ints may be
    numpy integers; a float, bool or str is refused, never truncated.
    """
    checked = validate_prompts(prompts, vocab_size)
    batch = len(checked)
    if isinstance(max_new_tokens, Iterable):
        limits = list(as_ints(max_new_tokens, "max_new_tokens"))
        if len(limits) != batch:
            raise ValueError(f"got {len(limits)} max_new_tokens for {batch} prompts")
        if min(limits) < 1:  # a request is prefilled to its first token before its limit is looked at
            raise ValueError(f"max_new_tokens per request must be >= 1 (an int 0 for all returns empty completions), "
                             f"got {min(limits)} for request {limits.index(min(limits))}")
    else:
        limits = [as_int(max_new_tokens, "max_new_tokens")] * batch
        if limits[0] < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {limits[0]}")
    sampling = SamplingConfig() if sampling is None else sampling
    if isinstance(sampling, SamplingConfig):
        configs = [sampling] * batch
    elif isinstance(sampling, Sequence) and all(isinstance(c, SamplingConfig) for c in sampling):
        configs = list(sampling)
    else:
        hint = f"; build one with SamplingConfig(**{sampling!r})" if isinstance(sampling, dict) else ""
        raise TypeError(f"sampling must be a SamplingConfig or a list of one per prompt, got {sampling!r}{hint}")
    if len(configs) != batch:
        raise ValueError(f"got {len(configs)} sampling configs for {batch} prompts")
    if isinstance(seeds, Iterable):
        seed_list = list(as_ints(seeds, "seeds"))
    else:
        seed_list = [as_int(seeds, "seeds") + i for i in range(batch)]
    if len(seed_list) != batch:
        raise ValueError(f"got {len(seed_list)} seeds for {batch} prompts")
    stops = frozenset(as_ints(stop_ids, "stop_ids"))
    bad = sorted(s for s in stops if not 0 <= s < vocab_size)
    if bad:
        raise ValueError(f"stop_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    lens = [len(p) for p in checked]
    padded = np.zeros((batch, bucket(max(lens))), np.int32)
    for row, prompt in enumerate(checked):
        padded[row, : len(prompt)] = prompt
    return Requests(checked, lens, padded, SamplingParams.from_configs(configs), request_keys(seed_list),
                    limits, stops)


class AutoregressiveGenerator:
    """Jitted prefill + decode step over a target, and a host loop that drives them.

    ``target`` is anything implementing ``dspark_jax.decoding.target_protocol.SpeculativeTarget``.
    ``step_width > 1`` runs every decode step as a ``[B, step_width]`` forward (the new token
    first, padding after, logits at every position): the same target forward, cache length
    included, as a speculative verify of that width, so its greedy output is what
    ``SpeculativeDecoder(..., strict=True)`` reproduces token for token (``docs/EXACTNESS.md``).
    It costs a wider forward per token; the default ``1`` is the fast baseline.

    ``tap_layers`` (ascending decoder-layer ids) makes ``generate`` also return those layers' raw
    outputs at every position of prompt + answer (``GenerationResult.taps``), as the forwards that
    produced the answer computed them: what a target cache stores, without a second pass over the
    finished sequences. Under continuous batching a finished request's last token is tapped by
    the next step, so its row joins the next refill one step later.

    ``mesh`` (a ``jax.sharding.Mesh`` with a ``data`` axis) splits every batch across its devices
    by rows, the weights replicated: each device generates for its own rows, and the batch size
    must be a multiple of the axis size. A request's tokens do not depend on the split.
    """

    def __init__(
        self, target: SpeculativeTarget, *, step_width: int = 1, tap_layers: Sequence[int] = (),
        mesh: Mesh | None = None,
    ):
        step_width = as_int(step_width, "step_width")
        if step_width < 1:
            raise ValueError(f"step_width must be >= 1, got {step_width}")
        self.target, self.step_width = target, step_width
        self.tap_layers = check_tap_layers(tap_layers, target.cfg.num_layers)
        self.rows = RowSplit(mesh)
        self.params = self.rows.replicate(target.params)
        self._new_cache = self.rows.allocate(target.new_cache, num_static=2)
        taps = self.tap_layers

        def prefill(params, cache, tokens_BxP, prompt_lens_B, keys_B, sampling):
            out = target.apply(
                params, tokens_BxP, cache, n_new_B=prompt_lens_B, logits_at_B=prompt_lens_B - 1, tap_layers=taps
            )
            first = sample(out.logits, sampling, step_keys(keys_B, jnp.zeros_like(prompt_lens_B)))
            return first, out.cache, out.taps

        def decode_step(params, cache, tokens_B, active_B, step_B, keys_B, sampling):
            if step_width == 1:
                out = target.apply(
                    params,
                    tokens_B[:, None],
                    cache,
                    n_new_B=active_B.astype(jnp.int32),
                    logits_at_B=jnp.zeros_like(step_B),
                    tap_layers=taps,
                )
                logits = out.logits
            else:
                # Strict: a verify-shaped forward (all positions' logits); only token 0 is real.
                padded = jnp.zeros((tokens_B.shape[0], step_width), jnp.int32).at[:, 0].set(tokens_B)
                out = target.apply(params, padded, cache, n_new_B=active_B.astype(jnp.int32), tap_layers=taps)
                logits = out.logits[:, 0]
            # The fed token's taps (an inactive row's too: its position is still its cache length).
            return sample(logits, sampling, step_keys(keys_B, step_B)), out.cache, out.taps[:, 0]

        # The cache is donated: every layer's K/V buffer is updated in place.
        self._prefill = jax.jit(self.rows.per_row(prefill, replicated=(0,)), donate_argnums=(1,))
        self._decode_step = jax.jit(self.rows.per_row(decode_step, replicated=(0,)), donate_argnums=(1,))
        self._state_rows = StateRows(lambda batch: (
            target.new_cache(batch, 1), jnp.zeros((batch,), jnp.int32), request_keys(range(batch)),
            SamplingParams.broadcast(SamplingConfig(), batch),
        ))
        self._insert, self._take = self._state_rows.insert, self._state_rows.take

    def on_rows(self, tree):
        """Per-request arrays (leading axis = batch) where the generator runs them."""
        return self.rows.on_rows(tree)

    def new_cache(self, batch: int, max_len: int):
        return self._new_cache(batch, max_len)

    @in_mesh_scope
    def warmup(self, batch: int, prompt_len: int, max_len: int, *, refills: bool = False,
               buckets: bool = False) -> float:
        """Compile prefill and decode for these shapes on dummy inputs; returns seconds spent.
        ``refills``: also the prefills and row inserts of continuous batching into ``batch`` rows
        (every refill size), so that serving requests as they come compiles nothing. ``buckets``:
        all of it at every batch size ``generate(batch_buckets=True)`` runs, and the resizes."""
        start = time.perf_counter()
        sizes = refill_sizes(batch, self.rows.devices)
        for live in sizes if buckets else [batch]:
            cache, token_B, keys, params = self._dummy_prefill(live, prompt_len, max_len)
            # Host arrays go through the same numpy -> device conversions as in generate().
            step, active = self.on_rows((jnp.asarray([0] * live, jnp.int32), jnp.asarray(np.ones(live, bool))))
            token_B, cache, _ = self._decode_step(self.params, cache, token_B, active, step, keys, params)
            state = (cache, token_B, keys, params)
            if refills:
                state = self._state_rows.warm(state, live, lambda size: self._dummy_prefill(size, prompt_len, max_len),
                                              sizes, sizes if buckets else [batch])
            jax.block_until_ready(state)
        return time.perf_counter() - start

    def _dummy_prefill(self, batch: int, prompt_len: int, max_len: int):
        """Per-row state (cache, first token, keys, sampling) of ``batch`` one-token prompts padded
        as a ``prompt_len`` prompt is."""
        params, keys, tokens, lens = self.on_rows((
            SamplingParams.broadcast(SamplingConfig(), batch), request_keys(range(batch)),
            jnp.asarray(np.zeros((batch, prompt_width(prompt_len, max_len)), np.int32)), jnp.asarray([1] * batch, jnp.int32),
        ))
        token_B, cache, _ = self._prefill(self.params, self.new_cache(batch, max_len), tokens, lens, keys, params)
        return cache, token_B, keys, params

    @property
    def slack(self) -> int:
        """Cache slots reserved past prompt + new tokens: as many as ``SpeculativeDecoder`` reserves
        for a verify of this width, so that both use the same cache length."""
        return 0 if self.step_width == 1 else self.step_width

    def cache_len_for(self, prompt_lens: Sequence[int], max_new_tokens: int) -> int:
        return cache_len(prompt_lens, max_new_tokens, self.target.cfg.max_position_embeddings, self.slack)

    @in_mesh_scope
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
        seeds: Sequence[int] | int = 0,
        stop_ids: Sequence[int] = (),
        max_len: int | None = None,
        on_step: Callable[[np.ndarray], None] | None = None,
        batch_size: int | None = None,
        continuous: bool = True,
        on_finish: FinishCallback | None = None,
        on_tokens: TokensCallback | None = None,
        arrivals: Sequence[float] | None = None,
        batch_buckets: bool = False,
    ) -> GenerationResult:
        """Generate for token-id prompts.

        ``max_new_tokens`` is one int for all or one per request (the cache is sized for the
        largest); ``max_new_tokens=0`` returns empty completions without running the model. ``seeds`` is one
        int per request (or one int, request ``i`` then using ``seed + i``). ``stop_ids``: any number
        of token ids that end a request. ``max_len`` fixes the cache length (default: the longest
        prompt + max_new_tokens rounded up to a multiple of 128); either way prompt + max_new_tokens
        must fit the model's ``max_position_embeddings``.

        ``batch_size`` (default: every prompt at once) caps the rows decoded together; with more
        prompts than that, a finished request's row is prefilled with the next waiting prompt
        (continuous batching; ``continuous=False``: only once the whole batch has finished, i.e.
        fixed batches of ``batch_size`` in order). ``on_finish(index, tokens, reason)`` is called
        as each request finishes, ``on_tokens(index, tokens)`` with each request's tokens as they
        are committed (streaming). ``on_step`` gets each step's token per row.

        ``arrivals`` (online serving; default: every request at the start): per request, the
        seconds after this call at which it arrives. A request joins the batch at the first refill
        after its arrival, in order of arrival; with nothing to decode, the call sleeps until the
        next arrival. ``prefill_s`` and ``decode_s`` do not count that sleep.

        ``batch_buckets``: each step runs at the smallest of the batch sizes 1, 2, 4, ... (times
        the mesh's data-parallel devices), ``batch_size`` that holds the requests in flight, so a
        lightly loaded batch costs what a small one does; rows move (a copy of their cache) when
        the size changes. Every size compiles its own programs (``warmup(buckets=True)``), and
        ``on_step`` gets as many tokens as the step had rows.
        """
        called = time.perf_counter()  # arrivals count from here, not after the checks below
        requests = prepare_requests(prompts, self.target.cfg.vocab_size, max_new_tokens, sampling, seeds, stop_ids)
        count = requests.batch
        if requests.max_new_tokens == 0:
            return GenerationResult([[] for _ in range(count)], ["length"] * count, 0.0, 0.0, 0)
        slots = Slots(count, count if batch_size is None else as_int(batch_size, "batch_size"), self.rows.devices,
                      continuous=continuous, arrivals=arrivals, buckets=batch_buckets, start=called)
        self.rows.check_batch(slots.rows)
        # Fitting the default cache refuses positions past the model's: a max_len given by hand
        # must not skip that.
        fitted = self.cache_len_for(requests.lens, requests.max_new_tokens)
        max_len = fitted if max_len is None else requests.check_fits(max_len, self.slack)
        completions = Completions(slots, requests.limits, on_finish, on_tokens)
        out = completions.tokens
        # Taps per request: the prompt's from prefill, then each generated token's from the step
        # that feeds it. A finished request's last token is fed by the step after it finishes (its
        # row inactive), so with taps that row is held from refills until after that step:
        # ``untapped`` maps such rows to the request still owed the tap.
        taps = [[] for _ in range(count)] if self.tap_layers else None
        untapped: dict[int, int] = {}

        def resize(state, keep):
            """The state of the rows ``keep`` (``Slots.resize``); a held row moves with its tap."""
            moved = {}
            for new, old in enumerate(keep):
                moved.setdefault(int(old), new)
            owed = {moved[row]: request for row, request in untapped.items()}
            untapped.clear()
            untapped.update(owed)
            return self._take(state, keep)

        def emit(rows, tokens) -> None:
            before = slots.request_of.copy()
            for row, token in zip(rows, tokens):
                completions.emit(row, [token], int(token) in requests.stop_ids)
            if taps is not None:
                finished = np.flatnonzero((before != IDLE) & (slots.request_of == IDLE))
                untapped.update((int(row), int(before[row])) for row in finished)

        def record_taps(step_taps) -> None:
            step_taps = np.asarray(step_taps)
            fed = {int(row): int(slots.request_of[row]) for row in np.flatnonzero(slots.active)}
            for row, request in {**fed, **untapped}.items():
                taps[request].append(step_taps[row : row + 1])
            untapped.clear()

        state = None  # (cache, last token, keys, sampling parameters), per row
        prefill_s = decode_s = 0.0
        rows_per_step = []
        while True:
            while (fill := slots.refill(held=untapped)) is not None:
                rows, joining, size, whole, keep = fill
                start = time.perf_counter()
                if keep is not None:
                    state = resize(state, keep)
                padded, fill_lens, params, keys = requests.pick(joining + joining[:1] * (size - len(joining)), max_len)
                params, keys, tokens_BxP, lens_B = self.on_rows((
                    params, keys, jnp.asarray(padded), jnp.asarray(fill_lens, jnp.int32),
                ))
                token_B, cache, prompt_taps = self._prefill(
                    self.params, self.new_cache(size, max_len), tokens_BxP, lens_B, keys, params)
                filled = (cache, token_B, keys, params)
                state = filled if whole else self._insert(state, filled, rows, size, slots.live)
                first = np.asarray(token_B)
                prefill_s += time.perf_counter() - start
                if taps is not None:
                    # One transfer, then host slices (copies, not views of the padded batch):
                    # slicing the device array would compile a program for every prompt length.
                    prompt_taps = np.asarray(prompt_taps)
                    for i, (request, n) in enumerate(zip(joining, fill_lens)):
                        taps[request].append(prompt_taps[i, :n].copy())
                emit(rows, first)
                if on_step is not None:
                    on_step(first)
            if not slots.active.any() and not untapped:
                if slots.wait_for_arrival():  # requests still to arrive: idle until the next
                    continue
                break
            start = time.perf_counter()
            if (keep := slots.shrink(held=untapped)) is not None:
                state = resize(state, keep)
            cache, token_B, keys, params = state
            step_B, active_B = self.on_rows((
                jnp.asarray([len(out[r]) if r != IDLE else 0 for r in slots.request_of], jnp.int32),
                jnp.asarray(slots.active),
            ))
            token_B, cache, step_taps = self._decode_step(self.params, cache, token_B, active_B, step_B, keys, params)
            state = (cache, token_B, keys, params)
            if taps is not None:
                record_taps(step_taps)
            token_np = np.asarray(token_B)
            active_rows = np.flatnonzero(slots.active)
            emit(active_rows, token_np[active_rows])
            if on_step is not None:
                on_step(token_np)
            if active_rows.size:  # not a step that only taps finished rows' last tokens
                rows_per_step.append(slots.live)
            decode_s += time.perf_counter() - start
        if taps is not None:
            taps = [np.concatenate(parts) for parts in taps]
        return GenerationResult(out, completions.reasons, prefill_s, decode_s, len(rows_per_step), taps=taps,
                                rows_per_step=rows_per_step)
