"""The target cache: the target's own responses and the hidden states drafters train on.

For every training prompt the target answers through its chat template (spec §5.1: drafters
learn the target's distribution, so the labels are the target's responses, not a dataset's).
The forwards that produce the answer (prefill, then one decode step per token) also record, per
token of ``prompt + response``:

* ``features`` — the tapped layers' raw outputs, concatenated (the drafter's context, §1.2);
* ``hidden`` — the target's post-final-norm hidden state (the LM-head input), so the target's
  logits can be recomputed at train time with the frozen head (§4.6) instead of being stored;
* ``lse`` — ``logsumexp`` of the full-vocabulary logits from that stored hidden state. With it a
  drafter with a reduced head needs target logits only over its draft vocabulary: the target
  mass outside it is ``1 − Σ_in p``, exactly, without a ``[tokens, V]`` product per step.

A cache built with ``store_features=False`` keeps only the token ids and loss masks (5 bytes a
token): training then computes the three per-token arrays above on the fly with the frozen target
(``teacher_forced``: one forward over the finished sequence, then the same ``stored_arrays``),
which on an accelerator costs less than writing and reading 6.9 KB a token, and leaves the data
set bounded by generation alone. The two ways agree to one bf16 rounding step: a decode step and
a forward over the whole sequence round their float32 products differently (``docs/EXACTNESS.md``).

Format: a directory with ``manifest.json`` (what produced the cache; a resumed run must match
it) and ``shard-NNNNN.safetensors`` + ``shard-NNNNN.json`` per ``shard_size`` prompts. A shard
holds its sequences concatenated (``offsets`` delimits them); floats are bfloat16, the same
precision DeepSpec stores (hidden states of a bf16-trained model carry no more). At
SmolLM2-135M with 5 taps that is (5 + 1)·576·2 + 4 + 1 + 4 = 6,921 bytes per token. Prompts map
to shards by index and a shard is written to a temporary name and renamed when complete, so a
killed run resumes at the first missing shard, losing and duplicating nothing. For the same
reason a cache grows in place when prompts are appended to its list (more data seeds); the
manifest then describes the longest list and keeps the shorter ones in ``grown_from``, so a run
on a shorter list (an earlier training leg) still reads its own prefix of shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from einops import rearrange
from jax.sharding import Mesh
from tqdm.auto import tqdm

from dspark_jax import multihost
from dspark_jax.checkpoints import save_safetensors
from dspark_jax.config import (
    SamplingConfig,
    as_int,
    as_ints,
    check_context_taps,
    read_json,
    write_json,
)
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator, cache_len
from dspark_jax.models.layers import project
from dspark_jax.models.target import TargetModel

MANIFEST = "manifest.json"
FORMAT = "dspark-jax-target-cache"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Everything that determines the cache's contents (recorded in the manifest)."""

    tap_layers: tuple[int, ...]
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    seed: int = 0
    min_response_tokens: int = 8  # answers shorter are dropped (DeepSpec: 14 loss-mask tokens)
    shard_size: int = 64
    batch_size: int = 16
    # False: token ids and loss masks only; training computes the features (module doc).
    store_features: bool = True
    # True: a shard's answers share the batch_size rows by continuous batching (a finished answer's
    # row takes the next prompt) instead of fixed batches. It pays where answers often stop well
    # before max_new_tokens; where most run to it, fixed batches are already full and the refills'
    # extra prefill shapes cost compiles (docs/BENCHMARKS.md, "Building the target cache").
    continuous: bool = False

    def __post_init__(self):
        object.__setattr__(self, "tap_layers", as_ints(self.tap_layers, "CacheSpec.tap_layers"))
        for name in ("max_new_tokens", "max_prompt_tokens", "shard_size", "batch_size"):
            if as_int(getattr(self, name), f"CacheSpec.{name}") < 1:
                raise ValueError(f"CacheSpec.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("top_k", "seed", "min_response_tokens"):
            as_int(getattr(self, name), f"CacheSpec.{name}")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def _fingerprint(target: TargetModel) -> str:
    """A cheap identity of the target's weights (config + a strided sample of every array)."""
    digest = hashlib.sha256(json.dumps(target.cfg.to_dict(), sort_keys=True).encode())
    for p in target.params:
        flat = np.asarray(p).reshape(-1)
        digest.update(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]).tobytes())
    return digest.hexdigest()[:16]


def _prompt_digest(prompt_ids: Sequence[Sequence[int]]) -> str:
    digest = hashlib.sha256()
    for ids in prompt_ids:
        digest.update(np.asarray(ids, np.int32).tobytes() + b"|")
    return digest.hexdigest()[:16]


def stored_arrays(target: TargetModel, params, taps_BxSxF):
    """What the cache stores per token, from the raw outputs of the tapped layers followed by the
    target's last layer: the features (bf16), the post-final-norm hidden state (bf16) and the
    float32 ``logsumexp`` of the logits recomputed from that *rounded* hidden state, so that the
    two agree at train time."""
    d = target.cfg.hidden_size
    features, final = taps_BxSxF[..., :-d], taps_BxSxF[..., -d:]
    hidden = target.module(params).final_norm(final).astype(jnp.bfloat16)
    _, head = target.embedding_and_head(params)

    def chunk_lse(hidden_BxLxD):
        logits = project(hidden_BxLxD.astype(head.dtype), head).astype(jnp.float32)
        return jax.nn.logsumexp(logits, axis=-1)

    # One row's worth of logits at a time ([B, S/B, V], not [B, S, V]), in chunks along the
    # sequence: every chunk keeps all B rows, so a batch split across devices by rows stays split
    # (a loop over rows would gather them all onto every device).
    batch, length, _ = hidden.shape
    chunk = -(-length // batch)
    chunks = -(-length // chunk)
    padded = jnp.pad(hidden, ((0, 0), (0, chunks * chunk - length), (0, 0)))
    by_chunk = rearrange(padded, "b (n l) d -> n b l d", l=chunk)
    lse = rearrange(jax.lax.map(chunk_lse, by_chunk), "n b l -> b (n l)")[:, :length]
    return features.astype(jnp.bfloat16), hidden, lse


def cache_taps(target: TargetModel, tap_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layers whose raw outputs ``stored_arrays`` reads: the tapped ones, then the last."""
    return tuple(tap_layers) + (target.cfg.num_layers - 1,)


def teacher_forced(target: TargetModel, tap_layers: tuple[int, ...]):
    """The pure function ``(params, tokens_BxS, lens_B) -> (features, hidden, lse)`` over
    right-padded sequences, by one forward over them: what training computes from a cache of
    token ids alone (the cache writer gets the same arrays from the answer's own forwards)."""
    taps = cache_taps(target, tap_layers)

    def run(params, tokens_BxS, lens_B):
        cache = target.new_cache(tokens_BxS.shape[0], tokens_BxS.shape[1])
        out = target.apply(params, tokens_BxS, cache, n_new_B=lens_B, logits_at_B=jnp.zeros_like(lens_B), tap_layers=taps)
        return stored_arrays(target, params, out.taps)

    return run


# Rows per call when the cache writer turns a batch's taps into stored arrays (one compiled shape).
STORE_ROWS = 512


class TargetCacheWriter:
    """Builds (or resumes) a target cache for a list of tokenized prompts."""

    def __init__(self, target: TargetModel, spec: CacheSpec, out_dir, *, stop_ids: Sequence[int],
                 mesh: Mesh | None = None):
        """``mesh`` (a ``data`` axis) splits every batch of answers, and the stored arrays, across
        its devices by rows; ``spec.batch_size`` must be a multiple of its size."""
        check_context_taps(spec.tap_layers, target.cfg.num_layers)  # the final layer is stored apart, as hidden
        self.target, self.spec, self.dir = target, spec, Path(out_dir)
        self.stop_ids = tuple(int(s) for s in stop_ids)
        # The answers' own forwards give the stored arrays: no second pass over the sequences.
        taps = cache_taps(target, spec.tap_layers) if spec.store_features else ()
        self.generator = AutoregressiveGenerator(target, tap_layers=taps, mesh=mesh)
        devices = 1 if mesh is None else mesh.shape["data"]
        if spec.batch_size % devices:
            raise ValueError(f"CacheSpec.batch_size {spec.batch_size} is not divisible by the mesh's "
                             f"{devices} data-parallel devices")
        # Each device turns a contiguous block of the tokens into stored arrays, as one row.
        self.store_rows = -(-STORE_ROWS // devices) * devices
        self.stored_arrays = jax.jit(lambda params, taps_NxF: jax.tree.map(
            lambda x: rearrange(x, "b n ... -> (b n) ..."),
            stored_arrays(target, params, rearrange(taps_NxF, "(b n) f -> b n f", b=devices))))
        # One decode cache length for every batch: the decode step compiles once.
        self.max_len = cache_len([spec.max_prompt_tokens], spec.max_new_tokens, target.cfg.max_position_embeddings)

    def manifest(self, prompt_ids) -> dict:
        """What produced the cache, in its JSON form (tuples as lists) so it compares to a read one."""
        return json.loads(json.dumps({
            "format": FORMAT,
            "version": VERSION,
            "spec": dataclasses.asdict(self.spec),
            "target_config": self.target.cfg.to_dict(),
            "target_fingerprint": _fingerprint(self.target),
            "stop_ids": list(self.stop_ids),
            "num_prompts": len(prompt_ids),
            "prompts_digest": _prompt_digest(prompt_ids),
            "num_shards": -(-len(prompt_ids) // self.spec.shard_size),
            "hidden_size": self.target.cfg.hidden_size,
        }))

    def _check_manifest(self, manifest: dict, prompt_ids) -> int:
        """Start a cache, resume one, grow one whose prompts are a prefix of these, or serve a
        list the cache grew from; returns how many shards these prompts span."""
        path = self.dir / MANIFEST
        if not path.exists():
            self._write_manifest(manifest)
            return manifest["num_shards"]
        existing = _with_spec_defaults(read_json(path))
        keys = (set(existing) | set(manifest)) - {"grown_from"}
        changed = sorted(k for k in keys if existing.get(k) != manifest.get(k))
        if not changed:
            return manifest["num_shards"]
        if not set(changed) <= {"num_prompts", "prompts_digest", "num_shards"}:
            raise ValueError(
                f"{self.dir} holds a target cache built differently (fields {changed} differ); "
                "use another directory or delete it to rebuild"
            )
        listed = {"num_prompts": manifest["num_prompts"], "prompts_digest": manifest["prompts_digest"]}
        if listed in existing.get("grown_from", []):  # an earlier, shorter list of the same cache
            last = manifest["num_shards"] - 1
            if manifest["num_prompts"] % self.spec.shard_size and not shard_done(self.dir, last):
                raise ValueError(
                    f"{self.dir}: shard {last} also holds prompts of the longer list the cache grew to "
                    f"({existing['num_prompts']} prompts) and is missing; resume the build with that list first"
                )
            return manifest["num_shards"]
        old = existing["num_prompts"]
        if not (old < len(prompt_ids) and _prompt_digest(prompt_ids[:old]) == existing["prompts_digest"]):
            raise ValueError(
                f"{self.dir} holds a target cache of other prompts ({old} prompts; these {len(prompt_ids)} "
                "neither extend them nor are a list it grew from); use another directory or delete it to rebuild"
            )
        # Shards are fixed runs of shard_size prompts seeded by index, so the full ones stay valid
        # when prompts are appended; a partial last shard is written again with its new prompts
        # (removed before the manifest changes, so a kill in between leaves it simply missing).
        if old % self.spec.shard_size:
            stem = self.dir / f"shard-{old // self.spec.shard_size:05d}"
            for suffix in (".json", ".safetensors"):
                stem.with_suffix(suffix).unlink(missing_ok=True)
        earlier = {"num_prompts": old, "prompts_digest": existing["prompts_digest"]}
        self._write_manifest({**manifest, "grown_from": existing.get("grown_from", []) + [earlier]})
        return manifest["num_shards"]

    def _write_manifest(self, manifest: dict) -> None:
        write_json(self.dir / MANIFEST, manifest, indent=2)

    def build(
        self, prompt_ids: Sequence[Sequence[int]], prompt_names: Sequence[str], *, progress: bool = True,
        num_shards: int | None = None, deadline: float | None = None,
    ) -> int:
        """Write every missing shard of these prompts (only the first ``num_shards`` when given);
        returns how many shards they span, which is what ``load_target_cache`` should read.

        With a ``deadline`` (a ``time.monotonic()`` value) no shard is started after it: the
        cache is then complete up to some shard, which ``complete_shards`` counts, and a later
        build resumes it.

        Run by several processes (``dspark_jax.multihost``), each writes its own shards (by index)
        with its own devices, which the writer's ``mesh`` must then hold, and returns once all
        are written; the progress bar counts this process's shards."""
        if len(prompt_ids) != len(prompt_names):
            raise ValueError("need one name per prompt")
        too_long = [n for n, p in zip(prompt_names, prompt_ids) if len(p) > self.spec.max_prompt_tokens]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompts exceed max_prompt_tokens={self.spec.max_prompt_tokens} "
                f"(e.g. {too_long[:3]}); filter them before building the cache"
            )
        manifest = self.manifest(prompt_ids)
        # The lead starts, resumes or grows the cache; the others then find its manifest.
        spanned = self._check_manifest(manifest, prompt_ids) if multihost.is_lead() else None
        multihost.barrier(f"target cache manifest {self.dir}")
        if spanned is None:
            spanned = self._check_manifest(manifest, prompt_ids)
        size = self.spec.shard_size
        shards = range(spanned if num_shards is None else min(num_shards, spanned))
        todo = [i for i in multihost.share(shards) if not shard_done(self.dir, i)]
        total = min(len(prompt_ids), len(multihost.share(shards)) * size)
        done = total - sum(len(prompt_ids[i * size : (i + 1) * size]) for i in todo)
        # `initial` shows a resumed build's progress at once (an update() this early is not drawn).
        bar = tqdm(total=total, initial=done, desc="target cache", disable=not progress, unit="prompt")
        for shard in todo:
            if deadline is not None and time.monotonic() >= deadline:
                break
            lo = shard * size
            self._write_shard(shard, prompt_ids[lo : lo + size], prompt_names[lo : lo + size], lo)
            bar.update(len(prompt_ids[lo : lo + size]))
        bar.close()
        multihost.barrier(f"target cache shards {self.dir}")  # every process's shards are written
        return len(shards)

    def respond(self, prompts, first_index: int) -> tuple[list[list[int]], list[tuple | None]]:
        """The target's responses, ``batch_size`` rows at a time with the prompts taken shortest
        first (fixed batches, or continuous batching with ``spec.continuous``), and per response
        the stored arrays of prompt + response (``None`` without ``store_features``). Per-prompt
        seeds: a prompt's response does not depend on its batch."""
        spec = self.spec
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        result = self.generator.generate(
            [prompts[i] for i in order],
            max_new_tokens=spec.max_new_tokens,
            sampling=spec.sampling,
            seeds=[spec.seed * 1_000_003 + first_index + i for i in order],
            stop_ids=self.stop_ids,
            max_len=self.max_len,
            batch_size=spec.batch_size,
            continuous=spec.continuous,
        )
        responses: list[list[int]] = [[] for _ in prompts]
        per_token: list[tuple | None] = [None for _ in prompts]
        stored = self._stored(result.taps) if result.taps is not None else [None] * len(prompts)
        for i, tokens, arrays in zip(order, result.tokens, stored):
            responses[i], per_token[i] = tokens, arrays
        return responses, per_token

    def _stored(self, taps: list[np.ndarray]) -> list[tuple]:
        """``stored_arrays`` of each sequence's taps, computed over all of them in fixed-size row
        chunks (one compiled shape, no padding to the longest sequence)."""
        flat, size = np.concatenate(taps), self.store_rows
        rows = -(-len(flat) // size) * size
        flat = np.concatenate([flat, np.zeros((rows - len(flat), flat.shape[1]), flat.dtype)])
        chunks = [jax.device_get(self.stored_arrays(self.generator.params, self.generator.on_rows(flat[lo : lo + size])))
                  for lo in range(0, rows, size)]
        features, hidden, lse = (np.concatenate([c[k] for c in chunks]) for k in range(3))
        bounds = np.cumsum([0] + [len(t) for t in taps])
        return [(features[a:b], hidden[a:b], lse[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def _write_shard(self, shard: int, prompts, names, first_index: int) -> None:
        spec = self.spec
        responses, per_token = self.respond(prompts, first_index)
        kept = [i for i, r in enumerate(responses) if len(r) >= spec.min_response_tokens]
        sequences = [list(prompts[i]) + responses[i] for i in kept]
        arrays = {k: [] for k in ("input_ids", "loss_mask", "features", "hidden", "lse")}
        arrays["input_ids"] = [np.asarray(seq, np.int32) for seq in sequences]
        if spec.store_features:
            for i in kept:
                for name, values in zip(("features", "hidden", "lse"), per_token[i]):
                    arrays[name].append(values)
        for i, seq_index in enumerate(kept):
            mask = np.zeros(len(sequences[i]), np.uint8)
            mask[len(prompts[seq_index]) :] = 1
            arrays["loss_mask"].append(mask)
        lengths = [len(s) for s in sequences]
        tensors = {
            "input_ids": _cat(arrays["input_ids"], np.int32, (0,)),
            "loss_mask": _cat(arrays["loss_mask"], np.uint8, (0,)),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        }
        if spec.store_features:
            d = self.target.cfg.hidden_size
            tensors["features"] = _cat(arrays["features"], ml_dtypes.bfloat16, (0, len(spec.tap_layers) * d))
            tensors["hidden"] = _cat(arrays["hidden"], ml_dtypes.bfloat16, (0, d))
            tensors["lse"] = _cat(arrays["lse"], np.float32, (0,))
        meta = {
            "shard": shard,
            "prompt_names": [names[i] for i in kept],
            "dropped": [{"name": names[i], "response_tokens": len(responses[i])}
                        for i in sorted(set(range(len(prompts))) - set(kept))],
            "response_tokens": [len(responses[i]) for i in kept],
            "tokens": int(sum(lengths)),
            "process": jax.process_index(),  # which process answered it (``build`` splits shards between them)
        }
        stem = self.dir / f"shard-{shard:05d}"
        tmp_tensors, tmp_meta = stem.with_suffix(".safetensors.tmp"), stem.with_suffix(".json.tmp")
        save_safetensors(tensors, tmp_tensors)
        tmp_meta.write_text(json.dumps(meta) + "\n")
        # Tensors first, metadata last: the .json marks a shard complete.
        os.replace(tmp_tensors, stem.with_suffix(".safetensors"))
        os.replace(tmp_meta, stem.with_suffix(".json"))


def _cat(parts, dtype, empty_shape):
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(empty_shape, dtype)


def shard_done(directory, shard: int) -> bool:
    stem = Path(directory) / f"shard-{shard:05d}"
    return stem.with_suffix(".json").exists() and stem.with_suffix(".safetensors").exists()


def complete_shards(directory, num_shards: int) -> int:
    """How many of the first ``num_shards`` shards are complete, counting from the first."""
    return next((i for i in range(num_shards) if not shard_done(directory, i)), num_shards)


@dataclasses.dataclass
class CachedSequence:
    name: str
    input_ids: np.ndarray  # [S] int32
    loss_mask: np.ndarray  # [S] uint8: 1 on response tokens
    # None in a cache without features (``CacheSpec.store_features=False``)
    features: np.ndarray | None  # [S, m·d] bfloat16
    hidden: np.ndarray | None  # [S, d] bfloat16
    lse: np.ndarray | None  # [S] float32


def _with_spec_defaults(manifest: dict) -> dict:
    """A manifest written before a ``CacheSpec`` field existed describes a cache built with that
    field's default (so an older cache still resumes and grows)."""
    defaults = {f.name: f.default for f in dataclasses.fields(CacheSpec) if f.default is not dataclasses.MISSING}
    if "spec" in manifest:
        manifest = {**manifest, "spec": {**defaults, **manifest["spec"]}}
    return manifest


def read_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a target cache: no {MANIFEST}")
    manifest = read_json(path)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} manifest")
    return _with_spec_defaults(manifest)


def answered_names(directory, num_shards: int) -> set[str]:
    """The ids of the prompts the first ``num_shards`` shards answered, those whose answers were
    dropped (too short) included."""
    names = set()
    for shard in range(num_shards):
        meta = read_json(Path(directory) / f"shard-{shard:05d}.json")
        names.update(meta["prompt_names"], (d["name"] for d in meta.get("dropped", [])))
    return names


def load_target_cache(directory, num_shards: int | None = None) -> list[CachedSequence]:
    """Every sequence of the cache's first ``num_shards`` shards (default: all), in prompt order.

    The shards asked for must be complete; taking a prefix lets training start on the shards a
    still-running build has finished, with the data it used named exactly."""
    manifest = read_manifest(directory)
    total = manifest["num_shards"]
    if num_shards is None:
        num_shards = total
    if not 1 <= num_shards <= total:
        raise ValueError(f"num_shards must be in [1, {total}] for {directory}, got {num_shards}")
    missing = [i for i in range(num_shards) if not shard_done(directory, i)]
    if missing:
        raise ValueError(f"target cache {directory} is incomplete: shards {missing[:5]} missing; rerun to resume")
    out = []
    for shard in range(num_shards):
        names, t = _read_shard(directory, shard, features=manifest["spec"]["store_features"])
        off = t["offsets"]
        for i, name in enumerate(names):
            s = slice(int(off[i]), int(off[i + 1]))
            per_token = [t[k][s] if k in t else None for k in ("features", "hidden", "lse")]
            out.append(CachedSequence(name, t["input_ids"][s], t["loss_mask"][s], *per_token))
    return out


def _read_shard(directory, shard: int, *, features: bool) -> tuple[list[str], dict[str, np.ndarray]]:
    """A complete shard's prompt names and tensors, checked to agree with each other: a damaged
    file (a disk error, an edit) is named here instead of training on shifted sequences."""
    stem = Path(directory) / f"shard-{shard:05d}"
    rebuild = f"delete {stem}.* and rerun to rebuild the shard"
    meta = read_json(stem.with_suffix(".json"))
    try:
        tensors = safetensors.numpy.load_file(str(stem.with_suffix(".safetensors")))
    except Exception as error:  # safetensors raises its own SafetensorError for a damaged file
        raise ValueError(f"{stem}.safetensors is damaged ({error}); {rebuild}") from None
    names, offsets = meta.get("prompt_names"), tensors.get("offsets")
    expected = {"input_ids", "loss_mask", "offsets"} | ({"features", "hidden", "lse"} if features else set())
    problems = []
    if not (isinstance(names, list) and len(meta.get("response_tokens", [])) == len(names)):
        problems.append(f"{stem}.json lists no prompt_names with one response_tokens each")
    if set(tensors) != expected:
        problems.append(f"tensors {sorted(tensors)}, expected {sorted(expected)}")
    elif (offsets.ndim != 1 or not isinstance(names, list) or len(offsets) != len(names) + 1 or offsets[0] != 0
          or np.any(np.diff(offsets) < 0)
          or any(len(tensors[k]) != offsets[-1] for k in expected - {"offsets"})):
        problems.append("its offsets do not delimit its prompts' tokens")
    if problems:
        raise ValueError(f"{stem} is damaged: {'; '.join(problems)}; {rebuild}")
    return names, tensors
