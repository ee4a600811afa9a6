"""The offline training-prompt mix: determinism, proportions, variety and benchmark hygiene."""

import ast
import doctest
import json
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dspark_jax.training.data import (
    BOXED,
    HUMANEVAL_PREFIX,
    MIX,
    MIXES,
    TrainingPrompt,
    build_prompts,
    check_against_benchmarks,
    check_no_overlap,
    load_benchmark_prompts,
    normalise_text,
    read_jsonl,
    write_jsonl,
)

REPO = Path(__file__).parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "benchmark_prompts.jsonl"
SHARED_BENCHMARKS = Path("/work/shared/benchmarks")


@pytest.fixture(scope="module")
def prompts():
    return build_prompts(3000, seed=0)


@pytest.fixture(scope="module")
def formats_prompts():
    return build_prompts(1000, seed=0, mix=MIXES["formats"])


@pytest.fixture(scope="module")
def writing_prompts():
    return build_prompts(1000, seed=0, mix=MIXES["writing"])


@pytest.fixture(scope="module")
def fixture_rows():
    return [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]


def test_same_seed_same_prompts_other_seed_other_prompts():
    a, b, c = build_prompts(400, seed=3), build_prompts(400, seed=3), build_prompts(400, seed=4)
    assert a == b
    assert len({p.text for p in a} & {p.text for p in c}) < 40


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1000, {"chat": 180, "math": 390, "code": 390, "instruction": 40}),
        # 1.26, 2.73, 2.73, 0.28: floors give 5, the two largest remainders (math, code) get +1.
        (7, {"chat": 1, "math": 3, "code": 3, "instruction": 0}),
        (0, {}),
    ],
)
def test_domain_counts_follow_the_mix_by_largest_remainder(n, expected):
    counts = Counter(p.domain for p in build_prompts(n, seed=1))
    assert dict(counts) == {d: k for d, k in expected.items() if k}


def test_custom_mix_and_bad_mix():
    assert {p.domain for p in build_prompts(50, mix={"math": 1.0})} == {"math"}
    with pytest.raises(ValueError, match="unknown domains"):
        build_prompts(10, mix={"poetry": 1.0})


def test_ids_are_stable_labels_and_order_is_shuffled(prompts):
    assert {p.domain for p in prompts} == set(MIX)
    by_domain: dict[str, list[int]] = {}
    for p in prompts:
        domain, index = p.id.rsplit("-", 1)
        assert domain == p.domain and re.fullmatch(r"\d{6}", index)
        by_domain.setdefault(domain, []).append(int(index))
    for indices in by_domain.values():
        assert sorted(indices) == list(range(len(indices)))
    switches = sum(a.domain != b.domain for a, b in zip(prompts, prompts[1:]))
    assert switches > len(prompts) / 2  # interleaved, not grouped by domain


def test_no_duplicates_and_real_variety(prompts):
    """Zero tolerance for exact duplicates (up to case and spacing): build_prompts rejects a
    repeat and draws again, so any duplicate is a bug. Template-level variety is checked too."""
    normalised = [" ".join(p.text.lower().split()) for p in prompts]
    assert len(set(normalised)) == len(prompts)
    assert len({p.text[:60] for p in prompts}) > 0.75 * len(prompts)


def test_prompt_shapes(prompts):
    assert sum(len(p.text) < 400 for p in prompts) > 0.9 * len(prompts)
    for p in prompts:
        for block in re.findall(r"```python\n(.*?)```", p.text, flags=re.S):
            assert block.count("\n") <= 30, p.id
    math = [p.text for p in prompts if p.domain == "math"]
    boxed = sum(t.endswith(BOXED) for t in math) / len(math)
    assert 0.35 < boxed < 0.65  # both the eval format and free-form problems
    code = [p.text for p in prompts if p.domain == "code"]
    assert sum("```python" in t for t in code) > 0.1 * len(code)


def test_check_no_overlap_detects_copies(fixture_rows):
    bench = [r["turns"][0] for r in fixture_rows]
    gsm = next(r["turns"][0] for r in fixture_rows if r["source"] == "gsm8k")
    mt = next(r["turns"][0] for r in fixture_rows if r["source"] == "mt-bench")
    span = " ".join(mt.split()[2:14])  # 12 words from inside an MT-Bench prompt
    planted = [
        TrainingPrompt("math-000007", "math", "  " + gsm.upper().replace(" ", "   ")),
        TrainingPrompt("chat-000003", "chat", f"My cousin asked me: {span}, right now?"),
        TrainingPrompt("code-000002", "code", "Please write a function to filter odd numbers, in Go."),
    ]
    for p in planted:
        with pytest.raises(ValueError, match=p.id):
            check_no_overlap([TrainingPrompt("ok-0", "chat", "Tell me about owls."), p], bench)
    with pytest.raises(ValueError, match="#0"):  # plain strings are accepted too
        check_no_overlap([gsm], bench)


def test_check_no_overlap_allows_boilerplate_and_short_spans(fixture_rows):
    bench = [r["turns"][0] for r in fixture_rows]
    mt = next(r["turns"][0] for r in fixture_rows if r["source"] == "mt-bench")
    check_no_overlap(
        [
            f"What is 17 times 23?\n{BOXED}",
            f"{HUMANEVAL_PREFIX}\n```python\ndef add(a, b):\n    \"\"\" Add two numbers.\n    \"\"\"\n```",
            "So: " + " ".join(mt.split()[2:13]) + " ... or not.",  # 11 shared words only
        ],
        bench,
    )


def test_stubs_are_valid_python_whose_examples_hold():
    """Every stub is a complete ``def`` whose docstring examples pass as doctests when the body is
    the reference solution; so a prompt never shows the target a wrong example."""
    from dspark_jax.training.data import _STUBS, _stub_prompt

    solutions = {stub.name: stub.solve for stub in _STUBS}
    texts = [_stub_prompt(random.Random(i)) for i in range(1500)]
    assert len({re.search(r"def (\w+)\(", t).group(1) for t in texts}) == len(_STUBS)
    assert any(" is None\n    True" in t for t in texts)  # a None result, which a doctest shows as nothing
    assert 0.3 < sum(t.startswith(HUMANEVAL_PREFIX) for t in texts) / len(texts) < 0.6
    runner = doctest.DocTestRunner()
    for text in texts:
        (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
        (function,) = [node for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)]
        docstring = ast.get_docstring(function, clean=True)
        test = doctest.DocTestParser().get_doctest(docstring, dict(solutions), function.name, None, 0)
        assert test.examples and runner.run(test, out=lambda _: None).failed == 0, text


def test_formats_mix_has_its_shares_and_varied_tasks(formats_prompts):
    assert Counter(p.domain for p in formats_prompts) == Counter(
        {"stub": 300, "code": 90, "math": 250, "task": 220, "chat": 100, "instruction": 40})
    tasks = [p.text for p in formats_prompts if p.domain == "task"]
    assert len(tasks) == 220 and len({t[:40] for t in tasks}) > 100
    for marker in ("Pretend to be", "Extract the", "Explain your reasoning", "real-world example", "Write a"):
        assert any(marker in t for t in tasks), marker


def test_writing_mix_has_its_shares_and_varied_long_form_requests(writing_prompts):
    assert Counter(p.domain for p in writing_prompts) == Counter(
        {"longform": 300, "stub": 300, "math": 250, "task_v2": 100, "instruction": 50})
    longform = [p.text for p in writing_prompts if p.domain == "longform"]
    assert len({t[:45] for t in longform}) > 100
    for marker in ("blog post", "story", "letter", "essay", "report", "outline", "speech", "feature article"):
        assert sum(marker in t for t in longform) >= 5, marker
    # Every request asks for a length or a structure of several parts.
    length = re.compile(r"in \d paragraphs|in about \d00 words|of about one page|headed sections|\d sections")
    assert all(length.search(t) for t in longform), [t for t in longform if not length.search(t)][:3]
    assert not [t for t in longform if re.search(r"\ba [aeio]|\ban [^aeiou]", t)]  # "a universal" is right


@pytest.mark.parametrize("domain, glitches", [("task", True), ("task_v2", False)])
def test_task_v2_fixes_the_wording_glitches_and_task_keeps_them(domain, glitches):
    texts = [p.text for p in build_prompts(600, seed=4, mix={domain: 1.0})]
    chains = [m.groups() for t in texts
              for m in [re.match(r"(\w+) is [a-z ]+ than (\w+), and \2 is [a-z ]+ than (\w+)\.", t)] if m]
    articles = re.findall(r"\d+, (an?) (\w)", "\n".join(texts))
    assert len(chains) > 10 and len(articles) > 100
    repeated = [c for c in chains if len(set(c)) < 3]
    wrong = [(a, v) for a, v in articles if (a == "an") != (v in "aeiou")]
    # "task" is frozen (an existing cache holds its texts), so its glitches must still be there.
    assert bool(repeated) == glitches and bool(wrong) == glitches, (repeated[:3], wrong[:3])


def test_built_set_does_not_overlap_the_fixture(prompts, formats_prompts, writing_prompts):
    for built in (prompts, formats_prompts, writing_prompts):
        assert check_against_benchmarks(built, FIXTURE) == 50


@pytest.mark.skipif(not SHARED_BENCHMARKS.is_dir(), reason=f"{SHARED_BENCHMARKS} not on this machine")
def test_built_set_does_not_overlap_the_full_benchmarks(prompts, formats_prompts, writing_prompts):
    for built in (prompts, formats_prompts, writing_prompts):
        assert check_against_benchmarks(built, SHARED_BENCHMARKS) > 2000


def test_load_benchmark_prompts_reads_first_turns(fixture_rows, tmp_path):
    texts = load_benchmark_prompts(FIXTURE)
    assert texts == [r["turns"][0] for r in fixture_rows]
    second_turns = {r["turns"][1] for r in fixture_rows if len(r["turns"]) > 1}
    assert second_turns and not second_turns & set(texts)
    (tmp_path / "a.jsonl").write_text('{"turns": ["one", "two"]}\n')
    (tmp_path / "b.jsonl").write_text('{"turns": ["three"]}\n\n')
    assert load_benchmark_prompts(tmp_path) == ["one", "three"]
    with pytest.raises(FileNotFoundError):
        load_benchmark_prompts(tmp_path / "missing")


def test_jsonl_round_trip(tmp_path):
    prompts = build_prompts(40, seed=5)
    write_jsonl(prompts, tmp_path / "p.jsonl")
    assert read_jsonl(tmp_path / "p.jsonl") == prompts


def test_a_prompts_file_of_your_own(tmp_path):
    """``TrainConfig.prompts_file``: text alone will do (ids by line, domain ``custom``); a line
    that is not a prompt, or an id given twice (the cache names answers by id), is named by line."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"text": "Summarise the Iliad."}\n\n{"text": "Sort a list in Rust.", "id": "rust", '
                    '"domain": "code"}\r\n{"text": "Line\u2028break"}\n')
    assert read_jsonl(path) == [TrainingPrompt("line-000001", "custom", "Summarise the Iliad."),
                                TrainingPrompt("rust", "code", "Sort a list in Rust."),
                                TrainingPrompt("line-000004", "custom", "Line\u2028break")]
    for text, message in [
        ('{"text": "a"}\n{"text": "b", "id": "line-000001"}\n', r":2: id 'line-000001' is also line 1's"),
        ('{"text": "a"}\n{"prompt": "b"}\n', ":2: a training prompt is a JSON object with a non-empty string 'text'"),
        ('{"text": "  "}\n', ":1: a training prompt is a JSON object"),
        ('{"text": "a", "turns": []}\n', r":1: unknown keys \['turns'\]"),
        ('{"text": "a", "id": 7}\n', ":1: 'id' and 'domain' are non-empty strings"),
        ('{"text": "a"\n', ":1: not JSON"),
        ("\n\n", "holds no prompts"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_jsonl(path)
    with pytest.raises(FileNotFoundError, match="prompts file .*missing.jsonl does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_other_seeds_can_repeat_training_prompts_and_the_exclusion_removes_them():
    """The shipped drafters trained on thousands of prompts; calibration's default seed (1000)
    repeats some of them word for word, which ``prompts_not_trained_on`` leaves out."""
    from dspark_jax.training.train import load_config, prompts_not_trained_on, training_prompts

    shipped = load_config(REPO / "configs" / "smollm2_135m_dspark.py")
    trained = {normalise_text(p.text) for leg in shipped.legs for p in training_prompts(leg)}
    generated = build_prompts(48, seed=1000, mix=MIX)
    repeated = [p for p in generated if normalise_text(p.text) in trained]
    assert repeated, "seed 1000 repeats no training prompt any more: the test lost its point"
    fresh = prompts_not_trained_on([shipped], 48, seed=1000, mix=MIX)
    assert len(fresh) == 48 - len(repeated) and not any(normalise_text(p.text) in trained for p in fresh)


def test_build_prompts_refuses_python_run_with_OO():
    """``python -OO`` strips the docstrings the code and chat pools are built from, so a seed would
    silently give another prompt set than the one its caches and drafters were built on."""
    result = subprocess.run([sys.executable, "-OO", "-c", "from dspark_jax.training.data import build_prompts; "
                             "build_prompts(4)"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "ValueError: build_prompts: Python runs with -OO" in result.stderr, result.stderr
