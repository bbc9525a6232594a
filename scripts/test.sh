#!/usr/bin/env bash
# The test command: lint and the import layering, then the whole CPU suite (about 20 minutes on 2 cores). pytest's
# exit 5 ("no tests collected") counts as a failure.
#   scripts/test.sh               the whole suite (the README's test command, CI's)
#   scripts/test.sh --quick       a few minutes: fast test files from each room, for the edit-test loop
#   scripts/test.sh ARGS...       pytest ARGS only (no lint), e.g. scripts/test.sh -x tests/kvcache
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
[ -x "$BIN/pytest" ] || BIN="$(dirname "$(command -v python3)")"

# One or two fast files per room (cli/args, server, rank, disagg, models, text, layers, ep, kernels, eplb, kvcache):
# the quick subset catches most slips in a few minutes; the whole suite stays the check before a commit lands.
QUICK=(
  tests/test_command_line.py tests/test_flag_registries.py tests/test_packaging.py
  tests/server/test_startup_failures.py tests/server/test_detokenizer.py tests/server/test_json_body.py
  tests/server/test_tokenizer_manager.py tests/text tests/kvcache
  tests/eplb/test_algorithm.py tests/eplb/test_location.py tests/ep/test_ep_routing.py tests/ep/test_tbo_split.py
  tests/kernels/test_rms_norm.py tests/kernels/test_moe_route.py tests/models/test_parity.py
  tests/models/test_config.py tests/rank/test_sampling.py tests/disagg/test_decode_rooms.py
  tests/disagg/test_prefill_rooms.py
)

lint=1
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- "${QUICK[@]}" "$@"
  echo "test-quick: ruff, lint-imports, then ${#QUICK[@]} fast test files (a few minutes); 'make test' runs all"
elif [ "$#" -eq 0 ]; then
  echo "test: ruff, lint-imports, then the whole CPU suite, pytest tests/ (about 20 minutes on 2 cores;" \
       "'make test-quick' runs a few minutes' subset)"
else
  lint=0
fi
start=$SECONDS
if [ "$lint" -eq 1 ] && [ -x "$BIN/ruff" ]; then
  "$BIN/ruff" check moeserve tests scripts benchmark || exit 1
  "$BIN/lint-imports" --no-cache || exit 1  # the layering of pyproject.toml's [tool.importlinter]
fi
"$BIN/python" -m pytest --durations=15 "$@"  # the slowest tests in the log: the suite must stay lean
rc=$?
echo "test: pytest exit code $rc after $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
