"""The user cache: a GGUF target is converted once and later loads read the float32 copy; the
command line keeps compiled programs. Each test points ``DSPARK_CACHE_DIR`` at its own directory."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from dspark_jax import cli
from dspark_jax.checkpoints import gguf as gguf_loading
from dspark_jax.checkpoints.gguf import converted_copy_dir, load_gguf
from tests.tiny import gguf_tensors, tiny_target, write_gguf

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "o Ġ", "Ġ w"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["hello world", "<|im_start|>user\nhello<|im_end|>", "digits 12345 and ünïcode"]


def _vocabulary() -> list[str]:
    byte_level = sorted(pre_tokenizers.ByteLevel.alphabet())
    return byte_level + [m.replace(" ", "") for m in MERGES] + SPECIAL


def write_tiny_gguf(path: Path, seed: int = 0):
    """A llama GGUF with a tiny random target's weights and a byte-level BPE tokenizer with a chat
    template; returns the target the file holds."""
    tokens = _vocabulary()
    target = tiny_target(seed=seed, vocab_size=len(tokens))

    def tokenizer_keys(writer):
        writer.add_tokenizer_pre("smollm")
        writer.add_token_merges(MERGES)
        writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t in tokens])
        writer.add_bos_token_id(tokens.index("<|im_start|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(True)
        writer.add_chat_template(TEMPLATE)

    write_gguf(path, target.cfg, gguf_tensors(target), tokens=tokens, metadata=tokenizer_keys)
    return target


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "user-cache"
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def assert_same_weights(target, expected):
    assert len(target.params) == len(expected.params)
    for got, want in zip(target.params, expected.params):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def assert_same_tokenizer(tokenizer, expected):
    for text in TEXTS:
        assert tokenizer.encode(text) == expected.encode(text)
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "hello world"}]
    assert tokenizer.apply_chat_template(messages) == expected.apply_chat_template(messages)
    for field in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template", "add_bos_token"):
        assert getattr(tokenizer, field) == getattr(expected, field), field


def refuse_to_parse_gguf(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf_loading, "read_gguf", refuse)


def test_a_gguf_is_converted_once_and_later_loads_read_the_copy(tiny_gguf, cache_dir, monkeypatch):
    path, written = tiny_gguf
    target, tokenizer = load_gguf(path)
    assert_same_weights(target, written)
    assert tokenizer.add_bos_token and tokenizer.encode("he")[0] == tokenizer.bos_token_id
    copy = converted_copy_dir(path)
    assert copy.parent == cache_dir / "converted" and copy.is_dir()
    assert [p.name for p in copy.parent.iterdir()] == [copy.name], "no staging directory is left behind"

    refuse_to_parse_gguf(monkeypatch)
    again, again_tokenizer = load_gguf(path)
    assert_same_weights(again, written)
    assert_same_tokenizer(again_tokenizer, tokenizer)
    assert again.cfg == target.cfg


def test_a_copy_left_half_written_by_a_killed_process_is_removed_when_old(tiny_gguf, cache_dir):
    path, written = tiny_gguf
    copy = converted_copy_dir(path)
    abandoned, in_progress = copy.parent / f".{copy.name}-killed", copy.parent / f".{copy.name}-writing"
    for staging in (abandoned, in_progress):
        staging.mkdir(parents=True)
        (staging / "config.json").write_text("{")
    two_hours_ago = time.time() - 7200
    os.utime(abandoned, (two_hours_ago, two_hours_ago))
    assert_same_weights(load_gguf(path)[0], written)
    assert sorted(p.name for p in copy.parent.iterdir()) == sorted([copy.name, in_progress.name])
    assert_same_weights(load_gguf(path)[0], written)


def test_a_damaged_copy_is_converted_again(tiny_gguf, cache_dir):
    path, written = tiny_gguf
    load_gguf(path)
    copy = converted_copy_dir(path)
    (copy / "model.safetensors").write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="unreadable.*converting .* again"):
        target, _ = load_gguf(path)
    assert_same_weights(target, written)
    assert_same_weights(load_gguf(path)[0], written)  # from the rebuilt copy, without a warning


def test_a_changed_file_gets_a_fresh_copy(tiny_gguf, cache_dir):
    path, _ = tiny_gguf
    load_gguf(path)
    first = converted_copy_dir(path)
    rewritten = write_tiny_gguf(path, seed=1)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))  # even on a coarse clock
    assert converted_copy_dir(path) != first
    assert_same_weights(load_gguf(path)[0], rewritten)
    assert converted_copy_dir(path).is_dir()


def test_turned_off_too_large_or_unwritable_copies_are_not_kept(tiny_gguf, cache_dir, monkeypatch):
    path, written = tiny_gguf
    monkeypatch.setenv("DSPARK_CACHE_DIR", "off")
    assert converted_copy_dir(path) is None
    assert_same_weights(load_gguf(path)[0], written)
    assert not cache_dir.exists()

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(cache_dir))
    assert_same_weights(load_gguf(path, cache=False)[0], written)
    assert not cache_dir.exists()

    monkeypatch.setattr(gguf_loading, "CONVERTED_COPY_MAX_BYTES", 1000)
    assert_same_weights(load_gguf(path)[0], written)
    assert not converted_copy_dir(path).exists()

    monkeypatch.undo()
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(cache_dir))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_loading, "save_hf_tensors", disk_full)
    with pytest.warns(UserWarning, match="could not keep a converted copy.*No space left"):
        target, _ = load_gguf(path)
    assert_same_weights(target, written)
    assert list((cache_dir / "converted").iterdir()) == [], "the partial copy is removed"


def test_convert_writes_a_checkpoint_the_command_line_loads_back(tiny_gguf, cache_dir, tmp_path):
    path, written = tiny_gguf
    out = tmp_path / "hf"
    assert cli.main(["convert", "--gguf", str(path), "--out", str(out)]) == 0
    assert not cache_dir.exists(), "convert writes one copy: the one asked for"
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    target, tokenizer = cli.load_target(str(out))
    assert_same_weights(target, written)
    assert_same_tokenizer(tokenizer, load_gguf(path, cache=False)[1])


def test_the_command_line_keeps_compiled_programs_in_the_user_cache(tiny_gguf, tmp_path):
    """In a fresh process (this one's JAX already has the test run's cache): ``off`` keeps none;
    otherwise ``dspark`` puts them in ``<DSPARK_CACHE_DIR>/xla``; a JAX setting of the user's wins."""
    path, _ = tiny_gguf
    script = textwrap.dedent("""
        import os, sys
        import jax, jax.numpy as jnp
        from dspark_jax import cli
        from dspark_jax.user_cache import enable_compilation_cache
        os.environ["DSPARK_CACHE_DIR"] = "off"
        assert enable_compilation_cache() is None and not jax.config.jax_compilation_cache_dir
        os.environ["DSPARK_CACHE_DIR"] = sys.argv[1]
        assert cli.main(["convert", "--gguf", sys.argv[2], "--out", sys.argv[3]]) == 0
        print(jax.config.jax_compilation_cache_dir)
        jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    root = tmp_path / "fresh-user-cache"
    run = subprocess.run([sys.executable, "-c", script, str(root), str(path), str(tmp_path / "hf")],
                         env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == str(root / "xla")
    assert any(p.name.endswith("-cache") for p in (root / "xla").iterdir()), "the jitted program was kept"

    from dspark_jax.user_cache import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    assert before and enable_compilation_cache() == Path(before) and jax.config.jax_compilation_cache_dir == before
