# metasched: `make run` and `make test` do all setup on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# Everything (dev tools and every extra) goes into .venv; torch is pinned here (not in
# pyproject, which keeps a range) so installs take the local CPU wheel.
CONSTRAINTS := constraints.txt
STAMP  := $(VENV)/.installed
# The one note setuptools prints on every editable install of this layout (the folders
# mapped into metasched need its import finder): information, not a problem to fix.
QUIET_BUILD := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: install run test test-all lint bench docs clean sandbox-tools

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(QUIET_BUILD) $(PIP) install --quiet -c $(CONSTRAINTS) -e '.[dev,train,ray,docs,e2b,predict]'
	@$(MAKE) --no-print-directory sandbox-tools
	touch $(STAMP)

# bubblewrap makes the live dispatcher's sandboxes (namespaces); slirp4netns and nftables
# give a sandbox granted network its own link and the rules confining it. Installed where
# this can (root and apt-get); elsewhere the dispatcher says what is missing, runs commands
# without isolation (no bubblewrap) and refuses granted network (no slirp4netns/nftables).
SANDBOX_PACKAGES = bwrap:bubblewrap slirp4netns:slirp4netns nft:nftables runsc:runsc
sandbox-tools:
	@missing=""; for pair in $(SANDBOX_PACKAGES); do \
		command -v $${pair%%:*} >/dev/null 2>&1 || [ -x /usr/sbin/$${pair%%:*} ] \
			|| missing="$$missing $${pair#*:}"; \
	done; \
	if [ -z "$$missing" ]; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing (sandboxes for the live dispatcher's commands)"; \
		{ apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; } \
			|| echo "warning:$$missing could not be installed: without bubblewrap commands run" \
				"without isolation; without slirp4netns or nftables granted network is refused;" \
				"without runsc sandbox.isolation=gvisor is refused"; \
	else \
		echo "note:$$missing missing and cannot be installed here (needs root and apt-get):" \
			"without bubblewrap commands run without isolation; without slirp4netns or" \
			"nftables granted network is refused; without runsc sandbox.isolation=gvisor" \
			"is refused"; \
	fi

install: $(STAMP)

# The first run: the step story at a tool-bound point in GRPO prompt groups (576 code-tool
# trajectories on 10 cores): today's practice, every rule the shipped meta-policy chooses
# among (its endgame fractions aside), the slack rule fed the learned predictor, the
# shipped policy (the meta-policy for the step) and the meta-policy for mean ACT.
RUN_ARGS ?= workload=retool_grouped_c10 \
	'schedulers=[static,fifo,elastic_greedy,rate_greedy,rate_greedy_step,critical_path,least_slack,slack_first,slack_first_predicted,checkpoints/default,checkpoints/meta_act]'

run: $(STAMP)
	$(VENV)/bin/metasched-eval $(RUN_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

# ruff, then the import contracts of pyproject.toml and no import circles, checked on
# the package as it installs (tools/import_contracts.py).
lint: $(STAMP)
	$(VENV)/bin/ruff check metasched envs agents tests benchmarks tools
	$(PY) tools/import_contracts.py

bench: $(STAMP)
	$(PY) benchmarks/sim_throughput.py

# The docs site into site/ (docs/api/openapi.json is written from the service by the build).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) outputs multirun site
