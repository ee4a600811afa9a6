"""The hardware-aware prefix scheduler (paper Algorithm 1 and its production variant), on device.

Per round, each active request ``r`` has drafted γ tokens with confidence logits ``z_{r,k}``;
``c_{r,k} = σ(z_{r,k} / T_k + b_k)`` (``T_k, b_k`` from ``training.calibrate``) estimates that
``x_{r,k}`` survives given that ``x_{r,<k}`` did, and ``a_{r,j} = Π_{k≤j} c_{r,k}`` that the
first ``j`` all survive. Verifying ``ℓ_r`` drafts is worth ``1 + Σ_{j≤ℓ_r} a_{r,j}`` expected
tokens, and the round costs what the profiled cost table says for the widest verify forward:
rows are padded to one width bucket ``W ≥ max_r ℓ_r + 1`` (``SpeculativeDecoder.width_for``), so
a round costs ``cost[W]`` seconds for the decoder's batch, drafting included.

Algorithm 1: start from ``ℓ = 0`` everywhere, admit candidates ``(r, j)`` in order of ``a``
(descending; ties by smaller ``j``, so a prefix comes before its extension), and stop at the
first one that does not raise the expected throughput ``Θ = E[tokens] / cost``. The stop is what
keeps the choice lossless: whether ``x_{r,k}`` is verified is settled when ``(r, k)`` is
reached, from values that do not depend on ``x_{r,k}`` (``a_{r,k+1}`` does, and it comes later);
a search for the best point of the whole path would let ``x_{r,k}`` decide its own admission
(paper Appendix A, ``tests/test_scheduler.py``).

The stop also traps Algorithm 1 below a cost cliff. In a batch, the first second draft widens
every row's verify forward while it adds one row's ``a``, so Θ falls there and the search ends at
one draft a row, even where two or more a row would pay. The paper's production variant (§5.2)
escapes by sizing each round's capacity with an unconstrained global search over confidences from
*earlier* rounds, which cannot depend on the current drafts, and then admitting the current drafts
by rank. Here rows are padded to one width, so the capacity is a width: after each round,
``next_round_plan`` picks the width that maximises Θ if every row verified its whole prefix up to
it (or no draft at all: a plain round), and with ``SchedulerPolicy(plan_ahead=True)`` the next
round starts Algorithm 1 from that many drafts per row (``prefix_lengths(floor=...)``), extending
it with the round's own confidences where they pay. A planned floor and the early stop above it
are both settled before the drafts they admit are known, so the output stays exactly the
target's. Without ``plan_ahead``, Algorithm 1 alone runs every round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import SamplingConfig, as_int
from dspark_jax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The confidence head's calibration for one way of decoding: per draft position a temperature
    ``T_k`` and a bias ``b_k``, so that ``c_k = σ(z_k / T_k + b_k)`` (``training.calibrate``).

    ``sampling`` is the decoding it was fitted on (greedy, or a temperature with top-k/top-p):
    acceptance, and so the right calibration, depends on it. ``None`` serves any decoding that
    has no calibration of its own (``calibration_index``).
    """

    temperatures: tuple
    biases: tuple
    sampling: SamplingConfig | None = None

    def __post_init__(self):
        # Tuples of floats whatever was given: the policy holding this is a static (hashed) jit argument.
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        object.__setattr__(self, "biases", tuple(float(b) for b in self.biases))
        if len(self.temperatures) != len(self.biases):
            raise ValueError(f"{len(self.temperatures)} calibration temperatures but {len(self.biases)} biases")
        if any(not (np.isfinite(t) and t > 0) for t in self.temperatures):
            raise ValueError(f"calibration temperatures must be positive, got {self.temperatures}")
        if any(not np.isfinite(b) for b in self.biases):
            raise ValueError(f"calibration biases must be finite, got {self.biases}")
        if self.sampling is not None and not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"a calibration's sampling must be a SamplingConfig or None, got {self.sampling!r}")


# top-k 0 (no filter) compared as a very large k, so that it is nearest to large k's.
_NO_TOP_K = float(2**30)


def calibration_index(calibrations: Sequence[Calibration], sampling: SamplingParams) -> jax.Array:
    """Per request, the index of the calibration that serves it; ``len(calibrations)`` for none
    (the raw ``σ(z)``).

    A greedy request takes the greedy calibration. A sampled one takes the sampled calibration
    nearest to its own setting: nearest temperature, then nearest top-p, then nearest top-k. A
    request whose mode (greedy or sampled) has no calibration takes the one fitted for any
    decoding (``sampling=None``), else none. Runs inside the jitted draft step: each request of a
    batch is served by its own sampling.
    """
    greedy_B = sampling.temperature_B <= 0.0
    top_k_B = jnp.where(sampling.top_k_B > 0, sampling.top_k_B.astype(jnp.float32), _NO_TOP_K)
    zero = jnp.zeros(greedy_B.shape, jnp.float32)
    keys = []  # per calibration and the "none" option: (tier, |ΔT|, |Δtop-p|, |Δtop-k|), compared in that order
    for c in calibrations:
        s = c.sampling
        if s is None:
            keys.append((zero + 1, zero, zero, zero))
        elif s.greedy:
            keys.append((jnp.where(greedy_B, 0.0, 3.0), zero, zero, zero))
        else:
            sampled_B = ~greedy_B
            keys.append((
                jnp.where(sampled_B, 0.0, 3.0),
                jnp.where(sampled_B, jnp.abs(sampling.temperature_B - s.temperature), 0.0),
                jnp.where(sampled_B, jnp.abs(sampling.top_p_B - s.top_p), 0.0),
                jnp.where(sampled_B, jnp.abs(top_k_B - (s.top_k or _NO_TOP_K)), 0.0),
            ))
    keys.append((zero + 2, zero, zero, zero))
    candidate = jnp.ones((greedy_B.shape[0], len(keys)), bool)
    for part in range(4):  # lexicographic: keep the candidates that are best in each part in turn
        value = jnp.where(candidate, jnp.stack([k[part] for k in keys], axis=1), jnp.inf)
        candidate &= value <= jnp.min(value, axis=1, keepdims=True)
    return jnp.argmax(candidate, axis=1).astype(jnp.int32)


def calibration_for(calibrations: Sequence[Calibration], sampling: SamplingConfig) -> Calibration | None:
    """The calibration that serves requests decoded with ``sampling`` (``calibration_index``)."""
    index = int(calibration_index(tuple(calibrations), SamplingParams.broadcast(sampling, 1))[0])
    return calibrations[index] if index < len(calibrations) else None


def survival(confidence_BxG: jax.Array, temperatures=1.0, biases=0.0) -> jax.Array:
    """``a_{r,j} = Π_{k≤j} σ(z_{r,k} / T_k + b_k)``: the chance that drafts ``1..j`` all survive.
    ``temperatures`` and ``biases`` broadcast against ``[B, γ]`` (defaults: the raw ``σ(z)``)."""
    z = confidence_BxG.astype(jnp.float32) / jnp.asarray(temperatures, jnp.float32) + jnp.asarray(biases, jnp.float32)
    return jnp.cumprod(jax.nn.sigmoid(z), axis=1)


def prefix_lengths(survival_BxG: jax.Array, active_B: jax.Array, widths: Sequence[int], costs: Sequence[float],
                   baseline_cost: float | None = None, floor: jax.Array | int = 0) -> jax.Array:
    """Algorithm 1 with its early stop: the verify length per request (0 for inactive rows).

    ``widths`` are the verify buckets (ascending; the last ``≥ γ + 1``) and ``costs[i]`` the
    seconds a round at ``widths[i]`` takes for this batch. ``baseline_cost`` is the cost of
    verifying nothing (default: a round at the narrowest width). ``floor`` (a scalar, possibly
    traced) admits the first ``floor`` drafts of every active row before the search starts, as
    planned before these drafts existed (``next_round_plan``); the search goes on from there.
    Vectorised: the admission order is one sort, and ``Θ`` after each admission a cumulative sum
    (expected tokens) over a cumulative max (the longest prefix so far, which fixes the width and
    so the cost).
    """
    batch, gamma = survival_BxG.shape
    if widths[-1] < gamma + 1:
        raise ValueError(f"the widest verify bucket ({widths[-1]}) must fit a block of {gamma} drafts plus the anchor")
    a = jnp.where(active_B[:, None], survival_BxG, 0.0).reshape(-1)
    slot = jnp.tile(jnp.arange(1, gamma + 1), batch)
    row = jnp.repeat(jnp.arange(batch), gamma)
    planned = (slot <= floor) & jnp.repeat(active_B, gamma)
    order = jnp.lexsort((row, slot, -a, ~planned))  # the planned first, then by a descending, smaller slot, row
    a_sorted, slot_sorted, row_sorted, planned_sorted = a[order], slot[order], row[order], planned[order]

    widths_arr = jnp.asarray(widths, jnp.int32)
    costs_arr = jnp.asarray(costs, jnp.float32)

    def cost_of(longest):  # the round's cost when the longest verified prefix is ``longest``
        return costs_arr[jnp.searchsorted(widths_arr, longest + 1)]

    # Θ_t = tokens_t / cost_t rises at candidate t iff a_t · cost_{t-1} > tokens_{t-1} · (cost_t − cost_{t-1}):
    # the same test as comparing the Θs, without rounding a tiny a_t away inside the sum.
    tokens = jnp.sum(active_B.astype(jnp.float32)) + jnp.cumsum(a_sorted)  # each active request yields >= 1
    cost = cost_of(jax.lax.cummax(slot_sorted))
    tokens_before = jnp.concatenate([tokens[:1] - a_sorted[:1], tokens[:-1]])
    baseline = cost_of(jnp.zeros((1,), jnp.int32)) if baseline_cost is None else jnp.full((1,), baseline_cost, jnp.float32)
    cost_before = jnp.concatenate([baseline, cost[:-1]])
    rises = planned_sorted | (a_sorted * cost_before > tokens_before * (cost - cost_before))
    # Admit while Θ rises; the first candidate that does not raise it ends the search.
    admitted = jnp.cumprod(rises.astype(jnp.int32)).astype(bool)
    per_row = jnp.zeros((batch,), jnp.int32).at[row_sorted].add(admitted.astype(jnp.int32))
    return per_row


def next_round_plan(survival_BxG: jax.Array, active_B: jax.Array, widths: Sequence[int], costs: Sequence[float],
                    plain_cost: float | None = None) -> jax.Array:
    """The production variant's capacity for the *next* round, from this round's survivals: a
    global search (no early stop) over the verify widths for the best ``Θ`` if every active row
    verified ``W - 1`` drafts, and over a plain round (no draft, ``plain_cost``) if it is timed.
    Returns ``W - 1`` (capped at γ) for the best width, or -1 when a plain round is best.

    The search looks at every ``a`` at once, so it must never decide which of *these* drafts are
    verified (paper Appendix A); the next round's drafts do not exist yet, so it may decide theirs.
    Ties go to the cheaper choice.
    """
    gamma = survival_BxG.shape[1]
    a = jnp.where(active_B[:, None], survival_BxG, 0.0)
    requests = jnp.sum(active_B.astype(jnp.float32))
    # Expected tokens with every active row verifying its first ℓ drafts, ℓ = 0..γ.
    tokens = requests + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.sum(a, axis=0))])
    drafts = np.minimum(np.asarray(widths) - 1, gamma)
    theta = tokens[drafts] / jnp.asarray(costs, jnp.float32)
    choices = jnp.asarray(drafts, jnp.int32)
    if plain_cost is not None:
        theta = jnp.concatenate([jnp.reshape(requests / plain_cost, (1,)), theta])
        choices = jnp.concatenate([jnp.full((1,), -1, jnp.int32), choices])
    return choices[jnp.argmax(theta)]  # the first best: the cheapest


# The cost-table key of a round that skips the draft: a plain target step (ℓ = 0 for every row,
# run at the narrowest verify width).
PLAIN = 0


def cost_tables(tables: Mapping) -> dict[int, dict[int, float]]:
    """``{batch: {width: seconds}}`` with exact keys (ints, or the decimal strings a JSON file
    holds: "8", not "08" or "8.0", which would silently merge or truncate) and seconds that are
    numbers; a ``ValueError`` naming the entry otherwise."""

    def count(key, what: str) -> int:
        if isinstance(key, str):
            if key.isdigit() and str(int(key)) == key:
                return int(key)
            raise ValueError(f"{what} {key!r} is not a whole number")
        return as_int(key, what)

    if not isinstance(tables, Mapping):
        raise ValueError(f"cost tables map batch sizes to {{width: seconds}}, got {type(tables).__name__}")
    out: dict[int, dict[int, float]] = {}
    for b, table in tables.items():
        batch = count(b, "batch size")
        if batch in out:
            raise ValueError(f"batch size {batch} has two cost tables")
        if not isinstance(table, Mapping):
            raise ValueError(f"the cost table of batch {batch} maps widths to seconds, got {type(table).__name__}")
        out[batch] = {}
        for w, value in table.items():
            width = count(w, f"batch {batch}'s width")
            if width in out[batch]:
                raise ValueError(f"batch {batch}'s cost table times width {width} twice")
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"batch {batch}, width {width}: {value!r} is not a number of seconds")
            out[batch][width] = float(value)
    return out


@dataclasses.dataclass(frozen=True)
class SchedulerPolicy:
    """Verify lengths from Algorithm 1 over a profiled cost table (``scheduler.profile``).

    ``costs`` maps a batch size to ``{verify width: seconds a round}`` (``cost_tables``; kept as a
    hashable tuple); the decoder's batch must be in it and its verify widths must be the table's.
    A ``PLAIN`` (0) entry, the seconds of a round that skips the draft, lets the decoder stop
    drafting while drafts do not pay (``plan_next_round``). ``None`` is a policy still to be
    profiled (``scheduler.profile.profiled``; the CLI does it at start). ``calibrations`` (a temperature and
    a bias per draft slot, one set per way of decoding) calibrate the confidence head, each request
    by the one for its own sampling (``calibration_index``); none: ``σ(z)``.

    By default every round runs Algorithm 1 from zero drafts, and ``plan_next_round`` only
    decides whether the next round drafts at all. ``plan_ahead=True`` is the paper's
    production variant: each round's confidences also set the next round's capacity, and
    Algorithm 1 starts from it. It verifies more in batches, but on the 2-core CPU it was measured
    on it was not faster (``docs/BENCHMARKS.md``), hence not the default.
    """

    costs: tuple | None = None  # ((batch, ((width, seconds), ...)), ...): hashable, for the jitted step
    calibrations: tuple = ()
    plan_ahead: bool = False

    def __post_init__(self):
        if isinstance(self.costs, Mapping):
            object.__setattr__(self, "costs", _hashable(cost_tables(self.costs)))
        object.__setattr__(self, "calibrations", tuple(self.calibrations))
        if not all(isinstance(c, Calibration) for c in self.calibrations):
            raise ValueError(f"calibrations must be Calibration objects, got {self.calibrations!r}")
        if len({len(c.temperatures) for c in self.calibrations}) > 1:
            raise ValueError("calibrations of different lengths: "
                             f"{sorted({len(c.temperatures) for c in self.calibrations})} positions")
        fitted_on = [c.sampling for c in self.calibrations]
        if len(set(fitted_on)) != len(fitted_on):
            raise ValueError(f"two calibrations for the same sampling: {fitted_on}")
        if self.costs is not None and not self.costs:
            raise ValueError("a scheduler policy needs a cost table for at least one batch size")
        for batch, table in self.costs or ():
            widths = [w for w, _ in table if w != PLAIN]
            if batch < 1:
                raise ValueError(f"a cost table for batch size {batch}: batch sizes are >= 1")
            if not widths or widths != sorted(set(widths)) or widths[0] < 1:
                raise ValueError(f"cost table for batch {batch}: widths must be distinct, ascending and >= 1, got {widths}")
            if tuple(widths) != self.widths:
                raise ValueError(f"every batch's cost table must time the same verify widths: {widths} vs {list(self.widths)}")
            if any(not (np.isfinite(s) and s > 0) for _, s in table):
                raise ValueError(f"cost table for batch {batch}: every cost must be a positive number of seconds")

    @classmethod
    def from_tables(cls, tables: Mapping[int, Mapping[int, float]], calibrations: Sequence[Calibration] = (),
                    plan_ahead: bool = False):
        return cls(None, tuple(calibrations), plan_ahead).with_tables(tables)

    def with_tables(self, tables: Mapping[int, Mapping[int, float]]) -> SchedulerPolicy:
        """This policy over the cost tables ``{batch: {width: seconds}}`` (``PLAIN`` for a plain round)."""
        return dataclasses.replace(self, costs=_hashable(cost_tables(tables)))

    @property
    def widths(self) -> tuple[int, ...] | None:
        """The verify widths the table times (the decoder must use exactly these)."""
        return None if self.costs is None else tuple(w for w, _ in self.costs[0][1] if w != PLAIN)

    def check_widths(self, verify_widths: Sequence[int]) -> None:
        if self.widths is not None and tuple(verify_widths) != self.widths:
            raise ValueError(f"the decoder verifies at widths {list(verify_widths)} but the scheduler's cost table "
                             f"times {list(self.widths)}: time this decoder's widths (`dspark profile`, or "
                             "scheduler.profile.profile_round_costs on the decoder)")

    def check_gamma(self, gamma: int) -> None:
        if self.calibrations and len(self.calibrations[0].temperatures) != gamma:
            raise ValueError(f"a calibration of {len(self.calibrations[0].temperatures)} positions for a drafter of γ={gamma}")

    def check_batches(self, batches: Sequence[int]) -> None:
        """A clear error unless the cost table times every one of these batch sizes."""
        if self.costs is None:
            raise ValueError("this scheduler policy has no cost table yet: profile the decoder first "
                             "(dspark_jax.scheduler.profile.profiled, or `dspark profile`)")
        profiled = [b for b, _ in self.costs]
        missing = sorted(set(batches) - set(profiled))
        if missing:
            raise ValueError(f"the scheduler's cost table has no batch size {', '.join(map(str, missing))} "
                             f"(profiled: {', '.join(map(str, profiled))}); profile every batch size the "
                             "decoder runs (`dspark profile --batch ...`)")

    def _table(self, batch: int) -> tuple[list[int], list[float], float | None]:
        """``(widths, seconds, plain seconds or None)`` for ``batch`` rows."""
        self.check_batches([batch])
        table = dict(dict(self.costs)[batch])
        verify = [(w, t) for w, t in table.items() if w != PLAIN]
        # A narrow width timed slower than a wider one is timing noise: it costs what the wider does.
        seconds = np.minimum.accumulate(np.asarray([t for _, t in verify])[::-1])[::-1]
        return [w for w, _ in verify], seconds.tolist(), table.get(PLAIN)

    def _survival(self, confidence_BxG, gamma: int, sampling: SamplingParams) -> jax.Array:
        if confidence_BxG is None:
            raise ValueError("the scheduler needs a drafter with a confidence head")
        self.check_gamma(gamma)
        index_B = calibration_index(self.calibrations, sampling)
        raw = ((1.0,) * gamma, (0.0,) * gamma)
        temperatures = jnp.asarray([c.temperatures for c in self.calibrations] + [raw[0]], jnp.float32)
        biases = jnp.asarray([c.biases for c in self.calibrations] + [raw[1]], jnp.float32)
        return survival(confidence_BxG, temperatures[index_B], biases[index_B])

    def lengths(self, confidence_BxG, gamma: int, active_B, sampling: SamplingParams, floor=0) -> jax.Array:
        """Algorithm 1 from ``floor`` drafts a row (the last round's ``plan_next_round``)."""
        a = self._survival(confidence_BxG, gamma, sampling)
        widths, seconds, _ = self._table(confidence_BxG.shape[0])
        return prefix_lengths(a, active_B, widths, seconds, floor=floor if self.plan_ahead else 0)

    def plan_next_round(self, confidence_BxG, active_B, sampling: SamplingParams) -> jax.Array:
        """After a round, what the next one does: -1 for a plain round (no draft; only if the
        table times one), else the drafts every active row verifies before Algorithm 1 looks
        further. The decoder asks once a round has drafted, before the next round's drafts exist,
        so the plan cannot bias which tokens are verified.

        With ``plan_ahead``, the global search of ``next_round_plan``. Without, Algorithm 1 alone
        will choose, so the next round drafts (floor 0) only if Algorithm 1 against a plain round
        would have admitted a draft of this one: only its first admission depends on that
        baseline, and the first candidate is the best first draft (``a_{r,1} ≥ a_{r,j}``), so this
        is one comparison. A wider plan would draft rounds whose drafts it then does not verify.
        """
        widths, seconds, plain = self._table(confidence_BxG.shape[0])
        a = self._survival(confidence_BxG, confidence_BxG.shape[1], sampling)
        if self.plan_ahead:
            return next_round_plan(a, active_B, widths, seconds, plain)
        if plain is None:
            return jnp.zeros((), jnp.int32)
        requests = jnp.sum(active_B.astype(jnp.float32))
        best_first = jnp.max(jnp.where(active_B, a[:, 0], 0.0))
        one_draft = seconds[next(i for i, w in enumerate(widths) if w >= 2)]
        # (requests + a) / one_draft > requests / plain, multiplied out as in prefix_lengths.
        return jnp.where(best_first * plain > requests * (one_draft - plain), 0, -1).astype(jnp.int32)


def _hashable(tables: dict[int, dict[int, float]]) -> tuple:
    """``SchedulerPolicy.costs``: the tables as sorted tuples, hashable for the jitted step."""
    return tuple(sorted((batch, tuple(sorted(table.items()))) for batch, table in tables.items()))
