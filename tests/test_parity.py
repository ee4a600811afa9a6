"""Parity of our target model with HF transformers, the reference implementation.

* CI tests (no torch): compare against the goldens in ``tests/goldens/``, which
  ``scripts/make_goldens.py`` produced from transformers.
* ``@pytest.mark.torch_ref`` tests: compare against live transformers (skipped without torch).

Both use the same contract: max |Δlogit| <= 1e-3 at every position compared (the full vocab
wherever the reference has it) and 32-token greedy continuations identical.

Models: the embedded SmolLM2-135M-Instruct GGUF (Llama, tied embeddings, GQA 9/3), the committed
tiny Qwen3 fixture (QK-norm, head_dim 32 != 64/4, untied, rope_theta 1e6) and a tiny Llama with
llama3 RoPE scaling, untied embeddings and multi-query attention whose weights are regenerated
from a seed (``make_goldens.write_tiny_llama3``).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint
from dspark_jax.decoding.autoregressive import AutoregressiveGenerator, bucket

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "tests" / "goldens"

LOGIT_ATOL = 1e-3
NEW_TOKENS = 32
# The taps are the raw residual stream, whose scale varies by orders of magnitude across
# positions (SmolLM2's first token carries activations of ~2.5e4), so each (position, layer)
# is compared relative to its own largest entry. Measured float32 agreement: <= 1.4e-5 over
# every position of the SmolLM2 prompts (layer 14 of the plain text), ~1e-6 at last positions;
# a real error (wrong layer, a missing residual, a skipped norm) is O(1).
TAP_RTOL = 1e-4


def _load_make_goldens():
    """``scripts/make_goldens.py`` as a module: prompts, tiny configs, the tiny-Llama writer.

    Importing it needs neither torch nor transformers (only its reference functions do).
    """
    spec = importlib.util.spec_from_file_location(
        "make_goldens", ROOT / "scripts" / "make_goldens.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mg = _load_make_goldens()
MANIFEST = json.loads((GOLDENS / "manifest.json").read_text())


def _split(flat: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lens)[:-1])


def _golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDENS / f"{name}.npz") as data:
        return dict(data)


# --------------------------------------------------------------------------------------------
# our side


def our_forward(
    target, prompts, tap_layers=(), *, group_by_length=False
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Full logits ``[T, V]`` and taps ``[T, len(tap_layers) * d]`` per prompt.

    Prompts are right-padded (``n_new_B`` = the real lengths; causal attention keeps the padding
    from touching real positions) into one jitted call, or one per length bucket when
    ``group_by_length`` (less padding, more compiles).
    """
    forward = jax.jit(functools.partial(target.apply, tap_layers=tuple(tap_layers)))
    groups: dict[int, list[int]] = {}
    longest = bucket(max(map(len, prompts)))
    for i, prompt in enumerate(prompts):
        groups.setdefault(bucket(len(prompt)) if group_by_length else longest, []).append(i)
    out: list = [None] * len(prompts)
    for size, rows in sorted(groups.items()):
        tokens = np.zeros((len(rows), size), np.int32)
        for r, i in enumerate(rows):
            tokens[r, : len(prompts[i])] = prompts[i]
        lens = jnp.asarray([len(prompts[i]) for i in rows], jnp.int32)
        result = forward(
            target.params, jnp.asarray(tokens), target.new_cache(len(rows), size), n_new_B=lens
        )
        logits, taps = np.asarray(result.logits), np.asarray(result.taps)
        for r, i in enumerate(rows):
            out[i] = (logits[r, : len(prompts[i])], taps[r, : len(prompts[i])])
    return out


def our_greedy(target, prompts) -> list[list[int]]:
    """Greedy continuations from the batched AutoregressiveGenerator, with no stop ids."""
    result = AutoregressiveGenerator(target).generate(
        [list(map(int, p)) for p in prompts], max_new_tokens=NEW_TOKENS
    )
    return result.tokens


# --------------------------------------------------------------------------------------------
# comparisons (shared by the golden and the live tests)


def check_logits(rows: list[tuple[str, np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Assert max |ours - reference| <= LOGIT_ATOL for each (label, ours, reference)."""
    diffs = {}
    for label, ours, ref in rows:
        assert ours.shape == ref.shape, f"{label}: shape {ours.shape} vs reference {ref.shape}"
        assert np.isfinite(ours).all(), f"{label}: our logits have non-finite values"
        diffs[label] = float(np.max(np.abs(ours.astype(np.float64) - ref)))
    print("\nmax |Δlogit|: " + ", ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    bad = {k: v for k, v in diffs.items() if not v <= LOGIT_ATOL}
    assert not bad, f"max |Δlogit| above {LOGIT_ATOL}: {bad}"
    return diffs


def check_greedy(names, ours, ref, margins=None) -> None:
    problems = []
    for i, (name, o, r) in enumerate(zip(names, ours, ref)):
        o, r = [int(t) for t in o], [int(t) for t in r]
        assert len(r) == NEW_TOKENS, f"{name}: reference has {len(r)} tokens"
        if o != r:
            step = next((s for s, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
            margin = (
                ""
                if margins is None or step >= len(r)
                else f" (HF top-1/top-2 margin {margins[i][step]:.2e})"
            )
            problems.append(f"{name}: first difference at step {step}{margin}: ours {o} vs HF {r}")
    assert not problems, "greedy continuations differ:\n" + "\n".join(problems)


def check_taps(rows: list[tuple[str, np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Assert each position's max |Δ| <= TAP_RTOL * that position's max |reference|."""
    worst = {}
    for label, ours, ref in rows:
        assert ours.shape == ref.shape, f"{label}: shape {ours.shape} vs reference {ref.shape}"
        err = np.max(np.abs(ours.astype(np.float64) - ref), axis=-1)
        scale = np.max(np.abs(ref), axis=-1)
        worst[label] = float(np.max(err / scale))
    print(
        "\nmax tap |Δ| / max |h| per position: "
        + ", ".join(f"{k}={v:.1e}" for k, v in worst.items())
    )
    bad = {k: v for k, v in worst.items() if not v <= TAP_RTOL}
    assert not bad, f"tapped hidden states differ by more than {TAP_RTOL} relative: {bad}"
    return worst


# --------------------------------------------------------------------------------------------
# SmolLM2 (the embedded GGUF) against the goldens

SMOLLM2_NAMES = [name for name, _ in mg.SMOLLM2_PROMPTS]


@pytest.fixture(scope="module")
def smollm2_golden():
    return _golden("smollm2")


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_golden):
    return [p.tolist() for p in _split(smollm2_golden["prompt_ids"], smollm2_golden["prompt_lens"])]


@pytest.fixture(scope="module")
def smollm2_ours(embedded_target, smollm2_prompts):
    target, _ = embedded_target
    return our_forward(target, smollm2_prompts, mg.SMOLLM2_TAP_LAYERS, group_by_length=True)


@pytest.fixture(scope="module")
def smollm2_our_greedy(embedded_target, smollm2_prompts):
    return our_greedy(embedded_target[0], smollm2_prompts)


def test_smollm2_golden_covers_the_required_prompts(
    embedded_target, smollm2_golden, smollm2_prompts
):
    _, tokenizer = embedded_target
    assert len(smollm2_prompts) >= 5
    # Our tokenizer still turns the prompt texts into the ids the reference was run on.
    assert mg.smollm2_prompt_ids(tokenizer) == smollm2_prompts
    lens = dict(zip(SMOLLM2_NAMES, map(len, smollm2_prompts)))
    assert lens["plain_text"] >= 200, lens
    assert tuple(smollm2_golden["tap_layers"]) == mg.SMOLLM2_TAP_LAYERS
    assert MANIFEST["versions"]["transformers"] and MANIFEST["versions"]["torch"]


def test_smollm2_golden_is_for_the_embedded_gguf():
    from dspark_jax.checkpoints.gguf import embedded_gguf_path

    assert mg.file_sha256(embedded_gguf_path()) == MANIFEST["smollm2"]["gguf_sha256"], (
        "the embedded GGUF differs from the one the goldens were made from; rerun scripts/make_goldens.py"
    )


def test_smollm2_logits_match_hf_golden(smollm2_golden, smollm2_ours):
    g = smollm2_golden
    subset = g["vocab_subset"]
    lens = g["prompt_lens"]
    subset_logits = _split(g["subset_logits"], lens)
    topk_ids, topk_logits = _split(g["topk_ids"], lens), _split(g["topk_logits"], lens)
    rows = []
    for i, name in enumerate(SMOLLM2_NAMES):
        logits, _ = smollm2_ours[i]
        rows.append((f"{name}/last-full-vocab", logits[-1], g["last_logits"][i]))
        rows.append((f"{name}/all-positions-subset", logits[:, subset], subset_logits[i]))
        rows.append(
            (
                f"{name}/all-positions-top{mg.SMOLLM2_TOPK}",
                np.take_along_axis(logits, topk_ids[i], -1),
                topk_logits[i],
            )
        )
    check_logits(rows)


def test_smollm2_taps_match_hf_golden(smollm2_golden, smollm2_ours):
    layers = mg.SMOLLM2_TAP_LAYERS
    rows = []
    for i, name in enumerate(SMOLLM2_NAMES):
        taps = smollm2_ours[i][1][-1].reshape(len(layers), -1)
        for j, layer in enumerate(layers):
            rows.append((f"{name}/layer{layer}", taps[j], smollm2_golden["last_taps"][i, j]))
    check_taps(rows)


def test_smollm2_greedy_matches_hf_golden(smollm2_golden, smollm2_our_greedy):
    check_greedy(
        SMOLLM2_NAMES,
        smollm2_our_greedy,
        smollm2_golden["greedy"],
        smollm2_golden["greedy_margins"],
    )


# --------------------------------------------------------------------------------------------
# tiny Qwen3 / llama3-RoPE Llama against the goldens

TINY = {
    "tiny_qwen3": (mg.TINY_QWEN3_CONFIG, mg.TINY_QWEN3_SEED),
    "tiny_llama3": (mg.TINY_LLAMA3_CONFIG, mg.TINY_LLAMA3_SEED),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {
        "tiny_qwen3": mg.TINY_QWEN3_DIR,
        "tiny_llama3": mg.write_tiny_llama3(tmp_path_factory.mktemp("tiny_llama3")),
    }


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tiny_dirs):
    name = request.param
    golden = _golden(name)
    prompts = [p.tolist() for p in _split(golden["prompt_ids"], golden["prompt_lens"])]
    target = load_hf_checkpoint(tiny_dirs[name])
    return name, target, golden, prompts


def test_tiny_checkpoints_are_what_the_goldens_describe(tiny_dirs):
    from safetensors.numpy import load_file

    qwen = load_hf_checkpoint(tiny_dirs["tiny_qwen3"]).cfg
    assert qwen.architecture == "qwen3" and qwen.qk_norm
    assert qwen.head_dim != qwen.hidden_size // qwen.num_heads
    assert qwen.num_kv_heads < qwen.num_heads and not qwen.tie_word_embeddings
    assert qwen.rope_theta == 1e6 and qwen.rope_scaling is None
    size = sum(f.stat().st_size for f in mg.TINY_QWEN3_DIR.iterdir())
    assert size < 1_000_000, f"tiny Qwen3 fixture is {size} bytes"
    committed = load_file(str(mg.TINY_QWEN3_DIR / "model.safetensors"))
    assert mg.weights_checksum(committed) == MANIFEST["tiny_qwen3"]["weights_sha256"]

    llama = load_hf_checkpoint(tiny_dirs["tiny_llama3"]).cfg
    assert llama.architecture == "llama" and not llama.qk_norm and not llama.tie_word_embeddings
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 8.0
    assert llama.num_kv_heads == 1
    # The seeded generator (numpy's default_rng) still produces the weights the golden used.
    regenerated = load_file(str(tiny_dirs["tiny_llama3"] / "model.safetensors"))
    assert mg.weights_checksum(regenerated) == MANIFEST["tiny_llama3"]["weights_sha256"]
    for name, (cfg, seed) in TINY.items():
        prompts = _split(_golden(name)["prompt_ids"], _golden(name)["prompt_lens"])
        assert [p.tolist() for p in prompts] == mg.tiny_prompts(cfg["vocab_size"], seed)
        assert max(map(len, prompts)) + NEW_TOKENS > 64  # past the llama3 original context


def test_tiny_logits_match_hf_golden(tiny):
    name, target, golden, prompts = tiny
    ours = our_forward(target, prompts)
    ref = _split(golden["logits"], golden["prompt_lens"])
    check_logits([(f"{name}/len{len(p)}", ours[i][0], ref[i]) for i, p in enumerate(prompts)])


def test_tiny_greedy_matches_hf_golden(tiny):
    name, target, golden, prompts = tiny
    names = [f"{name}/len{len(p)}" for p in prompts]
    check_greedy(names, our_greedy(target, prompts), golden["greedy"], golden["greedy_margins"])


# --------------------------------------------------------------------------------------------
# chat template against the goldens

CHAT = json.loads((GOLDENS / "chat_templates.json").read_text())
CHAT_CASES = [(t, i) for t in sorted(CHAT) for i in range(len(CHAT[t]["cases"]))]


def _chat_tokenizer(tokenizer, template_name):
    if template_name == "gguf":
        return tokenizer
    tok = copy.copy(tokenizer)
    tok.chat_template = CHAT[template_name]["template"]
    return tok


def _case_id(case):
    return f"{case[0]}-{CHAT[case[0]]['cases'][case[1]]['name']}"


def test_chat_golden_is_for_our_template_and_special_tokens(embedded_target):
    _, tokenizer = embedded_target
    assert CHAT["gguf"]["template"] == tokenizer.chat_template
    assert CHAT["feature"]["template"] == mg.FEATURE_TEMPLATE
    for entry in CHAT.values():
        assert entry["special_tokens"] == tokenizer.special_tokens_map
    for entry in CHAT.values():
        cases = [(c["name"], c["messages"], c["add_generation_prompt"]) for c in entry["cases"]]
        assert cases == [tuple(c) for c in mg.CHAT_CONVERSATIONS]
    assert len(mg.CHAT_CONVERSATIONS) >= 5


@pytest.mark.parametrize("case", CHAT_CASES, ids=_case_id)
def test_render_chat_matches_transformers_golden(embedded_target, case):
    template_name, index = case
    golden = CHAT[template_name]["cases"][index]
    tok = _chat_tokenizer(embedded_target[1], template_name)
    rendered = tok.render_chat(
        golden["messages"], add_generation_prompt=golden["add_generation_prompt"]
    )
    assert rendered == golden["text"]


@pytest.mark.parametrize("case", CHAT_CASES, ids=_case_id)
def test_chat_ids_match_golden_and_round_trip(embedded_target, case):
    template_name, index = case
    golden = CHAT[template_name]["cases"][index]
    tok = _chat_tokenizer(embedded_target[1], template_name)
    ids = tok.apply_chat_template(
        golden["messages"], add_generation_prompt=golden["add_generation_prompt"]
    )
    assert ids == golden["ids"]
    assert tok.decode(ids, skip_special_tokens=False) == golden["text"]
    # Every <|im_start|>/<|im_end|> in the text is one special token, never split into pieces.
    assert ids.count(1) == golden["text"].count("<|im_start|>")
    assert ids.count(2) == golden["text"].count("<|im_end|>")


def test_chat_special_tokens_are_single_tokens(embedded_target):
    _, tok = embedded_target
    assert tok.encode("<|im_start|>", add_bos=False) == [1]
    assert tok.encode("<|im_end|>", add_bos=False) == [2]
    assert tok.token(1) == "<|im_start|>" and tok.token(2) == "<|im_end|>"
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False)[::-1][0] == 2
    assert tok.decode([1, 2], skip_special_tokens=True) == ""


def test_render_chat_raises_like_transformers(embedded_target):
    import jinja2

    tok = _chat_tokenizer(embedded_target[1], "feature")
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        tok.render_chat([{"role": "tool", "content": "x"}])


# --------------------------------------------------------------------------------------------
# live transformers (pytest -m torch_ref)


def _hf_modules():
    torch = pytest.importorskip("torch")
    # One thread: on a 2-core machine shared with XLA's threads, torch's OpenMP spin-waits make
    # two threads ~5x slower than one.
    torch.set_num_threads(1)
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_smollm2(embedded_target, tmp_path_factory):
    _hf_modules()
    directory = save_hf_checkpoint(
        embedded_target[0].module(), tmp_path_factory.mktemp("smollm2_hf")
    )
    return mg.load_hf_model(directory, "llama")


@pytest.mark.torch_ref
def test_live_smollm2_logits_and_taps(hf_smollm2, smollm2_prompts, smollm2_ours, smollm2_golden):
    logit_rows, golden_rows, tap_rows = [], [], []
    for i, (name, prompt) in enumerate(zip(SMOLLM2_NAMES, smollm2_prompts)):
        ref_logits, ref_taps = mg._hf_forward(hf_smollm2, prompt, mg.SMOLLM2_TAP_LAYERS)
        logits, taps = smollm2_ours[i]
        logit_rows.append((f"{name}/all-positions-full-vocab", logits, ref_logits))
        golden_rows.append(
            (f"{name}/live-HF-vs-golden", ref_logits[-1], smollm2_golden["last_logits"][i])
        )
        taps = taps.reshape(len(prompt), len(mg.SMOLLM2_TAP_LAYERS), -1)
        for j, layer in enumerate(mg.SMOLLM2_TAP_LAYERS):
            tap_rows.append((f"{name}/layer{layer}", taps[:, j], ref_taps[j]))
    check_logits(logit_rows)
    check_taps(tap_rows)
    check_logits(golden_rows)  # the committed goldens still describe this transformers


@pytest.mark.torch_ref
def test_live_smollm2_greedy(hf_smollm2, smollm2_prompts, smollm2_our_greedy):
    ref, margins = zip(*(mg.hf_greedy(hf_smollm2, p) for p in smollm2_prompts))
    check_greedy(SMOLLM2_NAMES, smollm2_our_greedy, ref, margins)


@pytest.mark.torch_ref
def test_live_tiny(tiny, tiny_dirs):
    _hf_modules()
    name, target, golden, prompts = tiny
    model = mg.load_hf_model(tiny_dirs[name], TINY[name][0]["model_type"])
    ours = our_forward(target, prompts)
    names = [f"{name}/len{len(p)}" for p in prompts]
    ref = [mg._hf_forward(model, p)[0] for p in prompts]
    check_logits([(n, ours[i][0], ref[i]) for i, n in enumerate(names)])
    ref_greedy, margins = zip(*(mg.hf_greedy(model, p) for p in prompts))
    check_greedy(names, our_greedy(target, prompts), ref_greedy, margins)
    check_greedy(names, golden["greedy"], ref_greedy, margins)  # goldens still reproduce


@pytest.mark.torch_ref
def test_live_tiny_qwen3_fixture_is_reproducible(tmp_path):
    _hf_modules()
    from safetensors.numpy import load_file

    written = mg.write_tiny_qwen3_fixture(tmp_path / "tiny_qwen3")
    fresh, committed = (
        load_file(str(written / "model.safetensors")),
        load_file(str(mg.TINY_QWEN3_DIR / "model.safetensors")),
    )
    assert sorted(fresh) == sorted(committed)
    for name in fresh:
        np.testing.assert_array_equal(fresh[name], committed[name], err_msg=name)


@pytest.mark.torch_ref
@pytest.mark.parametrize("template_name", sorted(CHAT))
def test_live_chat_template(embedded_target, template_name):
    import jinja2

    transformers = _hf_modules()
    tok = _chat_tokenizer(embedded_target[1], template_name)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, chat_template=tok.chat_template, **tok.special_tokens_map
    )
    for name, messages, gen_prompt in mg.CHAT_CONVERSATIONS:
        expected = hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen_prompt
        )
        assert tok.render_chat(messages, add_generation_prompt=gen_prompt) == expected, name
        expected_ids = hf_tok(expected, add_special_tokens=False)["input_ids"]
        assert (
            tok.apply_chat_template(messages, add_generation_prompt=gen_prompt) == expected_ids
        ), name
    if template_name == "feature":
        for render in (hf_tok.apply_chat_template, tok.render_chat):
            with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
                render([{"role": "tool", "content": "x"}])
