"""The notebooks run as a user runs them: every cell in order, in a fresh Jupyter kernel (nbclient).
A cell that raises fails the test, and the notebooks assert what they show: greedy speculative
output identical to target-only, the training loss falling, streamed text joining to the whole.

The kernel inherits this run's environment (``conftest.py``): the embedded target's converted copy
and the compilation cache the other tests fill. Its temporary files go under the test's own
directory, and it runs there, so a notebook leaves nothing in the repository."""

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_named_in_the_readme_are_here():
    """So that a notebook renamed or deleted is noticed rather than dropped from the tests below."""
    assert {p.stem for p in NOTEBOOKS} == {"quickstart", "train_your_drafter", "serving_under_load"}


# The quickstart runs in CI. The other two (about two minutes each) run in `make test-all`:
# what they show is tested piece by piece in CI (training, calibration and profiling in
# test_train, test_calibrate and test_cli; serving in test_load and test_continuous_batching).
CI_NOTEBOOKS = {"quickstart"}


@pytest.mark.parametrize("path", [p if p.stem in CI_NOTEBOOKS else pytest.param(p, marks=pytest.mark.slow)
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    # This interpreter's kernel, whatever kernels the user running the suite has installed
    # (JUPYTER_PATH comes before the user's own kernel directory).
    monkeypatch.setenv("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
