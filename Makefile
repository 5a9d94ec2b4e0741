# metasched: `make run` and `make test` do all setup on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# Everything (dev tools and every extra) goes into .venv; torch is pinned here (not in
# pyproject, which keeps a range) so installs take the local CPU wheel.
CONSTRAINTS := constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: install run test test-all lint bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[dev,train]'
	touch $(STAMP)

install: $(STAMP)

# The first run: a contended point (one GPU for rm_math's three reward models), where
# schedulers differ, with today's practice, the heuristics and the shipped policy side by side.
RUN_ARGS ?= workload=rm_math cluster.gpu.devices=1 \
	'schedulers=[static,fifo,elastic_greedy,rate_greedy,checkpoints/default]'

run: $(STAMP)
	$(VENV)/bin/metasched-eval $(RUN_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

lint: $(STAMP)
	$(VENV)/bin/ruff check metasched envs agents tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/sim_throughput.py

clean:
	rm -rf $(VENV) outputs multirun
