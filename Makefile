# hpcnn: `make test` and `make demo` each set themselves up on a fresh machine
# (create .venv if missing, install the package with the extras they need, then run).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# One BLAS thread per process: MPI tests run several ranks on few cores.
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: test test-long demo bench docs clean lab labs-reference gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,localmpi,data,docs]'
	touch $@

# The optional C fast path of the allreduce wrapper, built with the MPI's own mpicc; without it
# hpcnn runs the same code path in Python (a failed build is reported, not fatal).
LEAN := hpcnn/parallel/collectives/.lean-built
$(LEAN): hpcnn/parallel/collectives/_lean.c hpcnn/parallel/collectives/lean_build.py $(VENV)/.installed
	$(BIN)/python -m hpcnn.parallel.collectives.lean_build --quiet && touch $@ \
		|| echo "hpcnn: continuing without the optional C fast path (see the message above)"

test: $(VENV)/.installed $(LEAN)
	$(BIN)/python -m pytest -q

# The tests marked long (setup.cfg's markers), left out of `make test` for its time budget.
test-long: $(VENV)/.installed $(LEAN)
	$(BIN)/python -m pytest -q -m long

# 4 data-parallel ranks, then a GPT on 2 data-parallel x 2 pipeline ranks (1F1B, 4 micro-batches),
# oversubscribed on small machines; `python -m mpi4py` makes an exception on one rank abort the
# job instead of hanging the others.
demo: $(VENV)/.installed $(LEAN)
	$(BIN)/hpcnn info
	$(BIN)/mpiexec -n 4 $(BIN)/python -m mpi4py -m hpcnn train --model=mlp --dp=4 --log=runs/demo-mlp-dp4.h5
	$(BIN)/hpcnn report runs/demo-mlp-dp4.h5 runs/demo-mlp-dp4.png
	$(BIN)/mpiexec -n 4 $(BIN)/python -m mpi4py -m hpcnn train --model=gpt --dp=2 --pp=2 \
		--schedule=1f1b --microbatches=4 --steps=150 --batch_size=32 --n_layers=4 --dim=64 \
		--eval_interval=50 --log_interval=25 --log=runs/demo-gpt-dp2-pp2.h5
	$(BIN)/hpcnn report runs/demo-gpt-dp2-pp2.h5 runs/demo-gpt-dp2-pp2.png
	$(BIN)/hpcnn train --model=gpt --n_layers=4 --half_layers=true --steps=50 --batch_size=32 \
		--lr=5e-3 --warmup=10 --clip=1 --remat=optimal --memory_budget=24 --eval_interval=25 \
		--log=runs/demo-gpt-remat.h5
	$(BIN)/hpcnn report runs/demo-gpt-remat.h5 runs/demo-gpt-remat.png
	@echo "--- what each demo run shows"
	@$(BIN)/hpcnn report --headline runs/demo-mlp-dp4.h5 runs/demo-gpt-dp2-pp2.h5 runs/demo-gpt-remat.h5

# The teaching labs (labs/README.md): `make lab N=1` grades labs/01-*/student.py (copied from
# the lab's skeleton.py); `make labs-reference` grades every lab's reference solution, which
# tests/test_labs.py also does (lab 1 within `make test`, the others within `make test-long`).
lab: $(VENV)/.installed
	@test -n "$(N)" || { echo "which lab? make lab N=1 (labs/README.md lists them)"; exit 2; }
	$(BIN)/python labs/grade.py $(N)

labs-reference: $(VENV)/.installed
	$(BIN)/python labs/grade.py --reference all

# The documentation site (mkdocs.yml, pages under docs/) into site/; --strict fails on a broken
# link, a missing image or a page left out of the nav. The options reference is generated from
# hpcnn/config.py at every build (docs/hooks.py).
docs: $(VENV)/.installed
	$(BIN)/python -c "import mkdocs, material" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[docs]'
	$(BIN)/python -m mkdocs build --strict -d site

# The GPU check (benchmarks/gpu_check.py, at most ~8 minutes on one GPU): every block kind, a GPT
# serial and on 2 ranks sharing the GPU (dp, tp, pp, ZeRO-1/2/3), mixed precision, against
# NumPy, then a throughput line beside PyTorch's. DEVICE=auto takes the GPU CuPy sees (install
# CuPy first: pip install -e '.[gpu]', the CUDA 12 wheel), else the strict
# backend; DEVICE=strict forces it.
DEVICE ?= auto
gpu-check: $(VENV)/.installed $(LEAN)
	$(BIN)/python benchmarks/gpu_check.py --device=$(DEVICE)

bench: $(VENV)/.installed $(LEAN)
	$(BIN)/python benchmarks/serial_step.py

clean:
	rm -rf runs site .pytest_cache build *.egg-info hpcnn/parallel/collectives/_lean*.so $(LEAN)
