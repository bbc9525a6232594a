# Two commands on a fresh machine:  `make serve`  (the server on the embedded model)  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/moeserve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install serve test lint
install: $(BIN)/moeserve

serve: install
	$(BIN)/moeserve serve $(ARGS)

test: install
	bash scripts/test.sh

lint: install
	$(BIN)/ruff check moeserve tests scripts
	$(BIN)/lint-imports --no-cache
