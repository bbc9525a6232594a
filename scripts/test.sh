#!/usr/bin/env bash
# The test command: lint and the import layering, then the whole CPU suite. pytest's exit 5 ("no tests collected") counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
[ -x "$BIN/pytest" ] || BIN="$(dirname "$(command -v python3)")"
if [ "$#" -eq 0 ] && [ -x "$BIN/ruff" ]; then
  "$BIN/ruff" check moeserve tests scripts benchmark || exit 1
  "$BIN/lint-imports" --no-cache || exit 1  # the layering of pyproject.toml's [tool.importlinter]
fi
"$BIN/python" -m pytest --durations=15 "$@"  # the slowest tests in the log: the suite must stay lean
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
