# Two commands on a fresh machine:  `make serve`  (the server on the embedded model)  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pyproject.toml asks for any torch >= 2.6; the set-up installs this build first (the CPU wheel the development
# machines and CI hold on disk), so that pip never downloads a CUDA build. `make install TORCH=` skips it, e.g. to
# keep a torch already in the environment, or where this version does not exist.
TORCH ?= torch==2.13.0

$(BIN)/moeserve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/pip install -q '$(TORCH)')
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install system-deps serve test lint
install: system-deps $(BIN)/moeserve

# System libraries that pip cannot bring (Mooncake's KV transfer needs libibverbs & co.): installed with apt-get
# as root on Debian/Ubuntu, otherwise listed; a no-op when present. PD still works without them (zmq backend).
system-deps:
	@bash scripts/install_system_deps.sh

serve: install
	$(BIN)/moeserve serve $(ARGS)

test: install
	bash scripts/test.sh

lint: install
	$(BIN)/ruff check moeserve tests scripts benchmark
	$(BIN)/lint-imports --no-cache
