"""The `dspark` command line on the embedded target."""

import pytest

from dspark_jax.cli import main


def test_generate_prints_text_and_speed(capsys):
    assert main(["generate", "--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "tokens/s" in err and "compile" in err


def test_bad_sampling_arguments_are_clear_errors(capsys):
    assert main(["generate", "--prompt", "Hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_empty_prompt_is_refused():
    with pytest.raises(SystemExit, match="--prompt is empty"):
        main(["generate", "--prompt", ""])
