# hpcnn: `make test` and `make demo` each set themselves up on a fresh machine
# (create .venv if missing, install the package with the extras they need, then run).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# One BLAS thread per process: MPI tests run several ranks on few cores.
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,localmpi,data]'
	touch $@

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

demo: $(VENV)/.installed
	$(BIN)/hpcnn info
	$(BIN)/hpcnn train --model=mlp --epochs=20 --log=runs/demo-mlp.h5
	$(BIN)/hpcnn report runs/demo-mlp.h5 runs/demo-mlp.png

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/serial_step.py

clean:
	rm -rf runs .pytest_cache build *.egg-info
