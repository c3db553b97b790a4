# Two commands: `make demo` and `make test`. Each builds .venv/ from nothing (fast when it exists).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the CPU torch wheel lies on local disk; an unpinned torch would pull a multi-GB CUDA build
TORCH  := torch==2.13.0

.PHONY: setup demo test test-slow lint test-python test-editors bench eval replay clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]' $(TORCH)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/dlm-lsp demo

test: setup lint test-python test-editors

# The whole suite as a slower machine runs it: pinned to one CPU that a busy loop shares (about half a
# core), so a test that assumes a speed fails here, not on a contributor's laptop or the next CI machine.
test-slow: setup
	bash scripts/slow-machine.sh $(MAKE) --no-print-directory test

# static checks: lint and format (ruff), types (mypy) on the product; settings in pyproject.toml
lint: setup
	$(VENV)/bin/ruff check engine dlm_lsp kernels tests scripts
	$(VENV)/bin/ruff format --check engine dlm_lsp kernels tests scripts
	$(VENV)/bin/mypy

test-python: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

# The editor suites test the clients against the real server process and engine, run on a tiny
# random-weight checkpoint that only writes printable text: fast to load and never an empty fill, so
# a client test never hinges on what the default model fills at one spot (the default model has
# its own end-to-end tests in tests/). DLM_ENGINE=inproc: each editor's server loads its own engine
# instead of starting (or finding) the user's shared engine daemon.
EDITOR_MODEL := .cache/editor-test-model

$(EDITOR_MODEL)/config.json: $(STAMP) tests/tiny.py
	$(PY) -c "from tests.tiny import make_tiny_checkpoint as m; m('$(EDITOR_MODEL)', printable=True)"

test-editors: setup $(EDITOR_MODEL)/config.json
	DLM_ENGINE=inproc DLM_LSP_CMD="$(abspath $(VENV))/bin/dlm-lsp serve" DLM_LSP_MODEL="$(abspath $(EDITOR_MODEL))" \
		bash editors/run-tests.sh

bench: setup
	$(VENV)/bin/dlm-lsp bench --json bench.json

eval: setup
	$(VENV)/bin/dlm-lsp eval --json eval.json

replay: setup
	$(VENV)/bin/dlm-lsp replay examples/tide_log.py --json replay.json --png replay.png

clean:
	rm -rf $(VENV) *.egg-info
