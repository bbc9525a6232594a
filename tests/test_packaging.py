"""Packaging: the project depends on a torch range (so `pip install moeserve` keeps a user's CUDA torch); its own
set-up (the Makefile behind `make serve` / `make test`) installs torch first through scripts/install_torch.sh, the
serving dependencies for `make serve` and the test tools only for `make test`."""

from __future__ import annotations

import http.server
import os
import re
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_torch_is_a_range_not_a_pin():
    deps = PYPROJECT["project"]["dependencies"]
    torch = [d for d in deps if re.match(r"torch\b", d)]
    assert torch == ["torch>=2.6"], torch


def test_serving_needs_no_test_tools_and_test_adds_them():
    serve = _names(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    test = _names(extras["test"])
    for tool in ("transformers", "pytest", "hypothesis", "schemathesis", "ruff", "import-linter", "matplotlib"):
        assert tool in test and tool not in serve, tool
    assert _names(extras["plot"]) == {"matplotlib"}


def _recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        body.append(line.strip())
    return body


def test_makefile_installs_torch_then_serving_then_test_tools():
    lines = (ROOT / "Makefile").read_text().splitlines()
    assert "TORCH ?= torch==2.13.0" in lines
    venv = _recipe("$(BIN)/moeserve")
    torch_step = next(i for i, line in enumerate(venv) if "scripts/install_torch.sh" in line and "$(TORCH)" in line)
    project_step = next(i for i, line in enumerate(venv) if line.endswith("pip install -q -e ."))
    assert torch_step < project_step
    assert not any("[test]" in line for line in venv)
    assert any("-e '.[test]'" in line for line in _recipe("$(VENV)/.test-tools"))
    targets = {line.split(":")[0]: line.split(":", 1)[1] for line in lines if re.match(r"^[a-z-]+:", line)}
    assert "install-test" in targets["test"] and "install-test" in targets["test-quick"]
    assert "install-test" not in targets["serve"]
    assert _recipe("test") == ["bash scripts/test.sh"]  # CI (.ci/run) runs `make test`: the whole suite
    assert _recipe("test-quick") == ["bash scripts/test.sh --quick"]


def test_quick_list_names_files_that_exist():
    text = (ROOT / "scripts" / "test.sh").read_text()
    quick = text[text.index("QUICK=(") + 7:text.index(")", text.index("QUICK=("))].split()
    assert len(quick) >= 10
    for path in quick:
        assert (ROOT / path).exists(), path


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A python that runs the script's inline checks with the real interpreter and records `-m pip` calls."""
    import sys

    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ]; then echo "$@" >> {tmp_path}/pip.log; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def _install_torch(python: Path, index: str) -> tuple[str, str]:
    env = {**os.environ, "TORCH_CPU_INDEX": index, "PATH": "/usr/bin:/bin"}  # no nvidia-smi on this PATH
    out = subprocess.run(["bash", str(ROOT / "scripts" / "install_torch.sh"), str(python), "torch==2.13.0"],
                         capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    return out, (python.parent / "pip.log").read_text()


needs_no_gpu = pytest.mark.skipif(bool(list(Path("/dev").glob("nvidia[0-9]*"))), reason="a GPU machine")


@needs_no_gpu
def test_install_torch_takes_the_cpu_index_when_it_answers(fake_python, tmp_path):
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "index"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}"
        out, pip = _install_torch(fake_python, index)
    finally:
        server.shutdown()
    assert "CPU build" in out
    assert pip.split() == ["-m", "pip", "install", "-q", "--index-url", index, "torch==2.13.0"]


@needs_no_gpu
def test_install_torch_falls_back_with_a_message_when_the_index_is_unreachable(fake_python):
    out, pip = _install_torch(fake_python, "http://127.0.0.1:9")  # the discard port: nothing listens
    assert "cannot be reached" in out and "CUDA build" in out
    assert pip.split() == ["-m", "pip", "install", "-q", "torch==2.13.0"]


def test_teardown_reports_after_the_summary_are_silenced():
    """conftest.py's pytest_unconfigure: what writes to stderr at interpreter exit (libtriton's nanobind leak
    report) is dropped once Triton was loaded, so that the summary ends the test command's output."""
    import sys

    code = ("import atexit, os, sys; atexit.register(lambda: os.write(2, b'nanobind: leaked 3 instances!\\n')); "
            "import triton; import tests.conftest as c; c.pytest_unconfigure(None); print('summary', flush=True); "
            "sys.stderr.write('still shown before exit\\n')")
    env = {k: v for k, v in os.environ.items() if k != "MOESERVE_TEST_TEARDOWN_STDERR"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout == "summary\n", r
    assert "still shown before exit" in r.stderr and "leaked" not in r.stderr, r.stderr
