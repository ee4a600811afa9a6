"""Greedy exactness on the real embedded target, independent of drafter quality.

A random drafter (nearly every draft rejected, so every round exercises rejection, rollback and
the verify forward at full width) and the shipped trained DSpark drafter (drafts accepted, so
rounds commit several tokens and roll back mid-block) on real benchmark prompts (tests/fixtures/
exactness_prompts.jsonl: 24 first turns of GSM8K, HumanEval, MT-Bench, MBPP and MATH-500,
chat-templated). Strict mode is asserted token-identical to its target-only reference; the
default mode to plain target-only decoding (it was exact on all of these when measured, see
docs/EXACTNESS.md; a failure there must be a near-tie to be acceptable, never a loosened test).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.autoregressive import AutoregressiveGenerator
from dspark_jax.decoding.speculative import FixedPolicy, SpeculativeDecoder
from tests.multidevice import run_on_eight_devices
from tests.prompts import random_drafter

GAMMA = 7
FIXTURE = Path(__file__).parent / "fixtures" / "exactness_prompts.jsonl"


def exactness_prompts(tokenizer) -> list[list[int]]:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in rows]


def mixed_batches(count: int, batch: int) -> list[list[int]]:
    """Prompt indices in batches that mix sources and lengths (the fixture is grouped by source)."""
    if batch == 1:
        return [[i] for i in range(count)]
    step = count // batch
    return [[i + j * step for j in range(batch)] for i in range(step)]


@pytest.fixture(scope="module")
def setup(embedded_target):
    target, tokenizer = embedded_target
    return target, random_drafter(target.cfg, GAMMA), exactness_prompts(tokenizer)


def test_fixture_has_24_prompts_of_five_sources(setup):
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    assert len(rows) == 24
    assert {r["source"] for r in rows} == {"gsm8k", "humaneval", "mt-bench", "mbpp", "math500"}
    lengths = [len(p) for p in setup[2]]
    assert min(lengths) < 64 < max(lengths)


def test_a_rows_logits_do_not_depend_on_its_index_in_a_strict_forward(setup):
    """The property strict mode rests on: in a ``[B, W]`` forward a position's logits are the same
    bits whether it is the first token of a step (target-only, strict) or token ``t`` of a verify."""
    target, _, prompts = setup
    batch = [prompts[i] for i in (0, 7, 13, 21)]
    width = GAMMA + 1
    prefill = jax.jit(lambda p, t, c, n: target.apply(p, t, c, n_new_B=n, logits_at_B=n - 1))
    wide = jax.jit(lambda p, t, c, n: target.apply(p, t, c, n_new_B=n))
    tokens = np.zeros((4, 256), np.int32)
    for row, prompt in enumerate(batch):
        tokens[row, : len(prompt)] = prompt
    lens = jnp.asarray([len(p) for p in batch], jnp.int32)
    out = prefill(target.params, jnp.asarray(tokens), target.new_cache(4, 384), lens)
    start, cache = out.cache, out.cache
    seq, steps = [np.asarray(jnp.argmax(out.logits, -1), np.int32)], []
    for _ in range(width):
        padded = np.zeros((4, width), np.int32)
        padded[:, 0] = seq[-1]
        o = wide(target.params, jnp.asarray(padded), cache, jnp.ones((4,), jnp.int32))
        cache = o.cache
        steps.append(np.asarray(o.logits[:, 0]))
        seq.append(steps[-1].argmax(-1).astype(np.int32))
    verify = wide(target.params, jnp.asarray(np.stack(seq[:width], 1)), start, jnp.full((4,), width, jnp.int32))
    np.testing.assert_array_equal(np.asarray(verify.logits), np.stack(steps, 1))


@dataclasses.dataclass(frozen=True)
class MixedLengthsPolicy:
    """ℓ = 0, 3, γ on rows 0, 1, 2 (mod 3): a plain step, part of a block and a whole one, from one
    compiled decoder."""

    def lengths(self, confidence_BxG, gamma, active_B, sampling):
        return jnp.asarray([0, 3, gamma], jnp.int32)[jnp.arange(active_B.shape[0]) % 3]


def shipped_drafter(name: str, target):
    from dspark_jax.checkpoints.drafter import load_drafter
    from dspark_jax.drafters import shipped_drafter_path

    return load_drafter(shipped_drafter_path(name), target=target.cfg)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("drafter_name", ["random", "smollm2_135m_dspark"])
def test_greedy_is_exact_on_24_benchmark_prompts(setup, batch, drafter_name):
    """≥ 20 real prompts x 64 tokens x ℓ ∈ {0, 1, 3, γ}: strict and default mode, with the random
    drafter (every round rejects) and the shipped trained one (rounds accept and roll back mid-block)."""
    target, drafter, prompts = setup
    if drafter_name != "random":
        drafter = shipped_drafter(drafter_name, target)
    groups = mixed_batches(len(prompts), batch)
    for strict in (True, False):
        decoders = {
            k: SpeculativeDecoder(target, drafter, policy=FixedPolicy(k), strict=strict) for k in (0, 1, 3, GAMMA)
        }
        generator = decoders[0].reference_generator() if strict else AutoregressiveGenerator(target)
        for group in groups:
            batch_prompts = [prompts[i] for i in group]
            reference = generator.generate(batch_prompts, max_new_tokens=64).tokens
            assert all(len(t) == 64 for t in reference)
            for k, decoder in decoders.items():
                got = decoder.generate(batch_prompts, max_new_tokens=64).tokens
                assert got == reference, f"strict={strict} ℓ={k} prompts {group}"


def test_shipped_dspark_drafter_is_exact_and_accepts_drafts(setup):
    """The shipped, trained drafter: drafts are accepted (τ > 1), so rounds commit several tokens
    and roll back mid-block, and greedy output is still the target's: in default mode that of
    target-only decoding, in strict mode with ℓ ∈ {0, 3, γ} token for token its reference's. (The
    fast CI variant of the slow test above: 4 real prompts, 48 tokens, B = 4.)"""
    target, _, prompts = setup
    drafter = shipped_drafter("smollm2_135m_dspark", target)
    batch = [prompts[i] for i in (1, 9, 14, 20)]
    plain = AutoregressiveGenerator(target).generate(batch, max_new_tokens=48)
    default = SpeculativeDecoder(target, drafter).generate(batch, max_new_tokens=48)
    assert default.tokens == plain.tokens
    assert default.tau > 1.1
    strict = SpeculativeDecoder(target, drafter, policy=MixedLengthsPolicy(), strict=True)
    result = strict.generate(batch, max_new_tokens=48)
    assert result.tokens == strict.reference_generator().generate(batch, max_new_tokens=48).tokens
    lengths, accepted = np.concatenate(result.verify_lengths), np.concatenate(result.accepted_per_round)
    assert set(lengths.tolist()) == {0, 3, GAMMA}
    assert ((accepted >= 2) & (accepted < lengths)).any(), "no round accepted drafts and rolled back mid-block"


@pytest.mark.slow
def test_shipped_drafter_on_eight_devices_is_exact_and_equals_one_device():
    """The shipped DSpark drafter with the real target on a mesh of 8 simulated devices (fresh
    process; a batch of 8 real prompts, one per device): strict greedy output is its target-only
    reference's on the same mesh and on one device, and sampled output (T = 0.7, top-k 20,
    top-p 0.8) is the 1-device decoder's, token for token."""
    script = textwrap.dedent("""
        import json
        import jax
        import numpy as np
        from jax.sharding import Mesh
        from dspark_jax.checkpoints.gguf import load_embedded_target
        from dspark_jax.config import SamplingConfig
        from dspark_jax.decoding.speculative import SpeculativeDecoder
        from tests.test_exactness import exactness_prompts, mixed_batches, shipped_drafter
        target, tokenizer = load_embedded_target()
        drafter = shipped_drafter("smollm2_135m_dspark", target)
        prompts = exactness_prompts(tokenizer)
        batch = [prompts[i] for i in mixed_batches(len(prompts), 8)[0]]
        sampling = SamplingConfig(temperature=0.7, top_k=20, top_p=0.8)
        mesh = Mesh(np.asarray(jax.devices()), ("data",))
        out = {}
        for name, m in (("one", None), ("eight", mesh)):
            decoder = SpeculativeDecoder(target, drafter, strict=True, mesh=m)
            greedy = decoder.generate(batch, max_new_tokens=48)
            out[name] = {"greedy": greedy.tokens, "tau": greedy.tau,
                         "reference": decoder.reference_generator().generate(batch, max_new_tokens=48).tokens,
                         "sampled": decoder.generate(batch, max_new_tokens=48, sampling=sampling, seeds=5).tokens}
        print(json.dumps(out))
    """)
    out = run_on_eight_devices(script)
    one, eight = out["one"], out["eight"]
    assert eight["greedy"] == eight["reference"] == one["reference"] == one["greedy"]
    assert eight["tau"] > 1.1, "the shipped drafter's drafts should be accepted"
    assert eight["sampled"] == one["sampled"]
