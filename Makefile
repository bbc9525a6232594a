# Two commands on a fresh machine:  `make serve`  (the server on the embedded model)  and  `make test`.
# `make serve` installs what serving needs; `make test` adds the test tools (pyproject.toml's `test` extra) and
# runs the whole CPU suite; `make test-quick` a few minutes' subset for the edit-test loop.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pyproject.toml asks for any torch >= 2.6; the set-up installs this build first (scripts/install_torch.sh: the CPU
# build from PyTorch's CPU wheel index on a machine without a GPU, the default build with one), so that pip never
# picks one on its own. `make install TORCH=` skips it, e.g. to keep a torch already in the environment.
TORCH ?= torch==2.13.0

$(BIN)/moeserve: pyproject.toml scripts/install_torch.sh
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	bash scripts/install_torch.sh $(BIN)/python '$(TORCH)'
	@echo "install: moeserve and what serving needs (pip install -e .)"
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-tools: $(BIN)/moeserve
	@echo "install: the test tools (pip install -e '.[test]': pytest, transformers, ruff, import-linter, ...)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install install-test system-deps serve test test-quick lint
install: system-deps $(BIN)/moeserve

install-test: install $(VENV)/.test-tools

# System libraries that pip cannot bring (Mooncake's KV transfer needs libibverbs & co.): installed with apt-get
# as root on Debian/Ubuntu, otherwise listed; a no-op when present. PD still works without them (zmq backend).
system-deps:
	@bash scripts/install_system_deps.sh

serve: install
	$(BIN)/moeserve serve $(ARGS)

test: install-test
	bash scripts/test.sh

test-quick: install-test
	bash scripts/test.sh --quick

lint: install-test
	$(BIN)/ruff check moeserve tests scripts benchmark
	$(BIN)/lint-imports --no-cache
