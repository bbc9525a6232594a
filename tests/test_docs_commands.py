"""The command blocks of README.md and docs/deploy.md, run or checked, so that the docs cannot drift from the code.

Every ```bash or ```python block there follows a marker comment that says how it is tested:

  <!-- test: server -->   CPU commands run as written, but on a free port instead of 30000: each `moeserve serve`
                          line starts a server (stopping the block's one before), waited for on /health and
                          probed with the openai client; every other line runs against it and must succeed (a
                          curl line must answer JSON without an error); the server is stopped with SIGTERM at
                          the end and must leave no process behind.
  <!-- test: client -->   the lines run against one server of the quick start (`moeserve serve`, the embedded
                          model).
  <!-- test: parse -->    GPU and multi-node commands: each `moeserve serve` parsed and validated by moeserve's own
                          argument parser and its layout checked against the model's shapes (tests/serve_commands.py),
                          for every node rank where the line has $NODE_RANK; a sglang-router line must take
                          only flags the router has and point at the servers of its block.
  <!-- test: parse scaled FLAGS -->  also run at CPU scale: the embedded model, FLAGS set (e.g. --tp-size 2), and
                          what only a GPU or a real checkpoint has dropped (SCALE_DROPS); node 0 started as `server`
                          does, the block's other nodes beside it on this machine.
  <!-- test: python -->   the block runs as a script.
  <!-- test: make -->     each `make TARGET` is dry-run (`make -n TARGET`).
  <!-- test: skip WHY --> not run; WHY is the reason pytest reports.

Commands that need work still under way elsewhere (PENDING below) are skipped, with the reason, until they exist.
The moeserve and python of the commands are this checkout's (`moeserve` is `python -m moeserve.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest

from moeserve.args import ServerArgs
from moeserve.paths import cache_root
from moeserve.server.launch import free_port
from tests.procs import descendants, free_port_block, sigterm_leaves_nothing, wait_healthy
from tests.serve_commands import ROOT, check_serve, flag_groups, scaled

DOCS = ("README.md", "docs/deploy.md")
COMMAND_LANGS = ("bash", "sh", "shell", "python")
KINDS = ("server", "client", "parse", "python", "make", "skip")
DOC_PORT = "30000"  # the port the docs' CPU commands use; each test runs them on a free one
DEADLINE_S = 180  # any one command, a server's start, a server's stop
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Dropped from a GPU command run at CPU scale: the checkpoint (the embedded model serves), the address, CUDA memory
SCALE_DROPS = ("--model-path", "--host", "--port", "--mem-fraction-static")

# Commands of first-run work under way (issue 51): (what must exist, the command that shows it, skip reason).
PENDING_MAKE = {"test-quick": "`make test-quick` is not in the Makefile yet"}
PENDING_FLAGS = {"--plot": (["bench", "serving", "--help"], "`moeserve bench serving --plot` does not exist yet")}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    kind: str | None  # None: no marker
    note: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


_FENCE = re.compile(r"^```(\w+)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!-- test: (\S+)\s*(.*?)\s*-->\s*$", re.S)


def doc_blocks(doc: str) -> list[Block]:
    """Every bash or python block of a doc, with the marker right above it (the line before the fence)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        if m.group(1) not in COMMAND_LANGS:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(doc, line, marker.group(1) if marker else None, marker.group(2) if marker else "",
                           m.group(2)))
    return found


BLOCKS = [b for doc in DOCS for b in doc_blocks(doc)]


def of_kind(kind: str) -> list:
    return [pytest.param(b, id=b.id) for b in BLOCKS if b.kind == kind]


def command_lines(text: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_every_command_block_says_how_it_is_tested():
    assert len(BLOCKS) >= 10, "the docs lost their commands, or this test lost them"
    unmarked = [b.id for b in BLOCKS if b.kind not in KINDS]
    assert not unmarked, f"command blocks without a `<!-- test: {'|'.join(KINDS)} -->` marker: {unmarked}"


# ---------------------------------------------------------------- running commands
@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict[str, str]:
    """The environment the commands run in: `moeserve` and `python` are this checkout's, the cache a fresh one
    (the compiled CPU kernels shared with the user's cache, so that they are not built again)."""
    tmp = tmp_path_factory.mktemp("docs_env")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "moeserve"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m moeserve.cli "$@"\n')
    shim.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    cache = tmp / "cache"
    cache.mkdir()
    if (cache_root() / "kernels").is_dir():
        (cache / "kernels").symlink_to(cache_root() / "kernels")
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MOESERVE_CACHE": str(cache),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def pending_reason(line: str, env: dict[str, str]) -> str | None:
    """Why a command cannot run yet (a flag of PENDING_FLAGS that the command's help does not list), or None."""
    for flag, (help_argv, reason) in PENDING_FLAGS.items():
        if flag in shlex.split(line, comments=True):
            shown = subprocess.run([sys.executable, "-m", "moeserve.cli", *help_argv], env=env, capture_output=True,
                                   text=True, timeout=DEADLINE_S)
            if flag not in shown.stdout:
                return reason
    return None


def run_line(line: str, env: dict[str, str], cwd: Path) -> None:
    """One command, to completion within the deadline; it must succeed, and a curl must get JSON without error."""
    out = subprocess.run(["bash", "-c", line], env=env, cwd=cwd, capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, f"{line}\nexit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    if line.startswith("curl "):
        answer = json.loads(out.stdout)
        assert "error" not in answer, f"{line}\n{out.stdout[:2000]}"


class DocServer:
    """A `moeserve serve` line of a doc, started on a free port, healthy and probed, stopped with SIGTERM."""

    def __init__(self, line: str, env: dict[str, str], cwd: Path, log: Path):
        self.port = free_port()
        command = re.sub(r"\s*&\s*(#.*)?$", "", line).replace(DOC_PORT, str(self.port))  # in the foreground
        if "--port" not in shlex.split(command, comments=True):
            command += f" --port {self.port}"
        self.url, self.log = f"http://127.0.0.1:{self.port}", log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(["bash", "-c", "exec " + command], env=env, cwd=cwd, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(self.proc, self.url, log, timeout=DEADLINE_S)
            self.workers = descendants(self.proc.pid)
            self.probe()
        except BaseException:
            self.proc.kill()
            raise

    def probe(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)
        (model,) = client.models.list().data
        out = client.completions.create(model=model.id, prompt="def add(a, b):", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("length", "stop")

    def stop(self) -> None:
        sigterm_leaves_nothing(self.proc, self.workers, self.log, timeout=DEADLINE_S)


def run_shell_block(block: Block, env: dict[str, str], cwd: Path, port: str | None = None) -> None:
    """The block's lines in order; `moeserve serve` lines start servers (one at a time), the rest run against
    the latest. port: where the lines' 30000 goes when the block starts no server of its own."""
    server: DocServer | None = None
    skipped = []
    try:
        for line in command_lines(block.text):
            if line.startswith("moeserve serve"):
                if server is not None:
                    server.stop()
                server = None
                server = DocServer(line, env, cwd, cwd / f"server-{block.line}.log")
                continue
            if reason := pending_reason(line, env):
                skipped.append(f"{line[:60]}...: {reason}")
                continue
            target = str(server.port) if server is not None else port
            assert target is not None, f"{line}: no server to run against"
            run_line(line.replace(DOC_PORT, target), env, cwd)
        if server is not None:
            server.stop()
            server = None
    finally:
        if server is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
    if skipped:
        pytest.skip("; ".join(skipped))


@pytest.mark.slow
@pytest.mark.parametrize("block", of_kind("server"))
def test_server_block_runs(block, shell_env, tmp_path):
    run_shell_block(block, shell_env, tmp_path)


@pytest.fixture(scope="module")
def quick_start_server(shell_env, tmp_path_factory):
    """The quick start's server: `moeserve serve`, the embedded model (as `make serve` runs it)."""
    tmp = tmp_path_factory.mktemp("quick_start")
    server = DocServer("moeserve serve", shell_env, tmp, tmp / "server.log")
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("block", of_kind("client"))
def test_client_block_runs(block, shell_env, quick_start_server, tmp_path):
    run_shell_block(block, shell_env, tmp_path, port=str(quick_start_server.port))


@pytest.mark.slow
@pytest.mark.parametrize("block", of_kind("python"))
def test_python_block_runs_as_a_script(block, shell_env, tmp_path):
    script = tmp_path / "recipe.py"
    script.write_text(block.text)
    out = subprocess.run([sys.executable, str(script)], env=shell_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=DEADLINE_S)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), "the script printed nothing"


@pytest.mark.parametrize("block", of_kind("make"))
def test_make_targets_exist(block):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    pending = []
    for line in command_lines(block.text):
        words = shlex.split(line, comments=True)
        assert words[0] == "make" and len(words) >= 2, f"{line}: make blocks hold make commands only"
        out = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        if out.returncode != 0 and words[1] in PENDING_MAKE:
            pending.append(PENDING_MAKE[words[1]])
            continue
        assert out.returncode == 0, f"make -n {' '.join(words[1:])}: {out.stderr[-2000:]}"
    if pending:
        pytest.skip("; ".join(pending))


@pytest.mark.parametrize("block", of_kind("skip"))
def test_skipped_block_says_why(block):
    assert block.note, f"{block.id}: `<!-- test: skip -->` needs a reason"
    pytest.skip(block.note)


# ---------------------------------------------------------------- GPU and multi-node commands, parsed
def serve_args(words: list[str]) -> list[ServerArgs]:
    """A `moeserve serve` command checked as every node that runs it takes it ($NODE_RANK: 0 .. --nnodes - 1)."""
    argv = words[2:]
    if "$NODE_RANK" not in argv:
        return [check_serve(argv)]
    first = check_serve([w.replace("$NODE_RANK", "0") for w in argv])
    return [first] + [check_serve([w.replace("$NODE_RANK", str(r)) for w in argv]) for r in range(1, first.nnodes)]


def reaches(url: str, args: ServerArgs) -> bool:
    """Whether url is the HTTP address of this server's node 0."""
    u = urlparse(url)
    if u.port != args.port or args.node_rank != 0:
        return False
    if args.host not in WILDCARD_HOSTS:
        return u.hostname == args.host
    return args.nnodes == 1 or u.hostname == args.dist_init_addr.rpartition(":")[0]


def router_flags() -> set[str]:
    sglang_router = pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    del sglang_router
    out = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))


def check_router(words: list[str], servers: list[ServerArgs]) -> None:
    """A sglang-router PD command: flags the router has, its prefill (URL and bootstrap port) and decode URLs those
    of the block's servers."""
    unknown = {w for w in words if w.startswith("--")} - router_flags()
    assert not unknown, f"sglang-router has no {sorted(unknown)}"
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", nargs="+", action="append", default=[])
    parser.add_argument("--decode", nargs=1, action="append", default=[])
    ns, _ = parser.parse_known_args(words[3:])
    assert ns.prefill and ns.decode, "a PD router needs --prefill and --decode"
    for url, *boot in ns.prefill:
        match = [a for a in servers if a.disaggregation_mode == "prefill" and reaches(url, a)]
        assert match, f"--prefill {url}: no prefill server of the block serves there"
        assert boot == [str(match[0].disaggregation_bootstrap_port)], f"--prefill {url} {boot}: the bootstrap port"
    for (url,) in ns.decode:
        assert any(a.disaggregation_mode == "decode" and reaches(url, a) for a in servers), \
            f"--decode {url}: no decode server of the block serves there"


@pytest.mark.parametrize("block", of_kind("parse"))
def test_gpu_commands_parse_and_fit_the_model(block):
    servers: list[ServerArgs] = []
    routers = []
    for line in command_lines(block.text):
        words = shlex.split(line, comments=True)
        if words[:2] == ["moeserve", "serve"]:
            servers += serve_args(words)
        elif words[:3] == ["python", "-m", "sglang_router.launch_router"]:
            routers.append(words)
        else:
            pytest.fail(f"{line}: parse blocks hold `moeserve serve` and sglang-router commands only")
    for args in servers:
        if args.disaggregation_mode != "null" and args.nnodes == 1:
            assert args.host not in WILDCARD_HOSTS, (
                "a one-node PD server bound to a wildcard tells the other side 127.0.0.1: bind it to its address")
    for words in routers:
        check_router(words, servers)


def scaled_blocks() -> list:
    return [pytest.param(b, id=b.id) for b in BLOCKS if b.kind == "parse" and b.note.startswith("scaled ")]


@pytest.mark.slow
@pytest.mark.parametrize("block", scaled_blocks())
def test_gpu_command_runs_scaled_to_cpu_ranks(block, shell_env, tmp_path):
    """The block's `moeserve serve` lines (one server, or one line per node of it) at CPU scale, all on this machine:
    node 0 started as `server` blocks start theirs, probed and stopped; every other node must then exit 0."""
    overrides = shlex.split(block.note.removeprefix("scaled "))
    lines = [shlex.split(line, comments=True) for line in command_lines(block.text)]
    assert all(words[:2] == ["moeserve", "serve"] for words in lines), "a scaled block holds `moeserve serve` lines"
    argvs = [scaled(words[2:], overrides, SCALE_DROPS) for words in lines]
    if len(argvs) > 1:  # one line per node: they meet at a local --dist-init-addr (its next ports taken too)
        dp = max(int(flag_groups(a).get("--dp-size", ["1"])[0]) for a in argvs)
        local = ["--dist-init-addr", f"127.0.0.1:{free_port_block(dp + 2)}"]
        argvs = [scaled(a, local, ()) for a in argvs]
    node0 = [a for a in argvs if flag_groups(a).get("--node-rank", ["0"]) == ["0"]]
    assert len(node0) == 1, "one line must be node 0"
    others = []
    try:
        for i, argv in enumerate(a for a in argvs if a is not node0[0]):
            with open(tmp_path / f"node-{i + 1}.log", "w") as log:
                others.append(subprocess.Popen([sys.executable, "-m", "moeserve.cli", "serve", *argv], env=shell_env,
                                               cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        server = DocServer(shlex.join(["moeserve", "serve", *node0[0]]), shell_env, tmp_path,
                           tmp_path / "server.log")
        server.stop()
        for proc in others:
            assert proc.wait(timeout=DEADLINE_S) == 0, "a node did not exit cleanly after node 0 stopped"
    finally:
        for proc in others:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
