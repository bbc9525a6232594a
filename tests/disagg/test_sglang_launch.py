"""SGLang's large-EP PD commands (its 96-GPU deployment of DeepSeek, sgl-project/sglang#6017), run by moeserve.

Every flag of both commands parses at SGLang's own values once DeepEP is replaced by all2all (refused by name
before). Then both commands, scaled to the embedded DeepSeek-V3 model (7.4 M parameters, 16 experts, its own
tokenizer) and 2 CPU ranks a side (2 DP groups each),
start behind sglang-router and serve requests with the single-rank greedy tokens. What the scaling changes, and
why, is the table `SCALED` below: sizes, addresses and files, and what a CPU cannot have (DeepEP, an InfiniBand
device). Everything else runs as SGLang's command says: DP attention, the DP LM head, dense TP 1, two-batch overlap,
normal (prefill) and low_latency (decode) dispatch, redundant experts planned from a load dump with DeepSeek's
policy, dynamic dispatch, the watchdog, one decode log line per step.
"""

from __future__ import annotations

import random
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.ep.registry import REFUSED_BACKENDS
from moeserve.rank.sampling_params import SamplingParams
from moeserve.server.launch import free_port
from tests.disagg.pd_procs import Server
from tests.procs import stop_process, wait_healthy
from tests.rank.inprocess import InProcessEngine

# The commands as SGLang publishes them (`python3 -m sglang.launch_server` and its environment left out; decode's
# SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=256 is moeserve's --ep-max-tokens-per-rank, in SCALED).
PREFILL = (
    "--model-path /dev/shm/DeepSeek-V3-0324 --disaggregation-ib-device mlx5_1 --disaggregation-mode prefill "
    "--dist-init-addr 10.5.55.3:5757 --nnodes 4 --node-rank 0 --tp-size 32 --dp-size 32 --enable-dp-attention "
    "--decode-log-interval 1 --enable-deepep-moe --page-size 1 --host 0.0.0.0 --trust-remote-code "
    "--moe-dense-tp-size 1 --enable-dp-lm-head --disable-radix-cache --watchdog-timeout 1000000 "
    "--enable-two-batch-overlap --deepep-mode normal --mem-fraction-static 0.85 --chunked-prefill-size 524288 "
    "--max-running-requests 8192 --max-total-tokens 131072 --context-length 8192 --init-expert-location YOUR_PATH "
    "--ep-num-redundant-experts 32 --ep-dispatch-algorithm dynamic --eplb-algorithm deepseek "
    "--deepep-config YOUR_PATH")
DECODE = (
    "--model-path /dev/shm/DeepSeek-V3-0324 --disaggregation-ib-device mlx5_1 --disaggregation-mode decode "
    "--dist-init-addr 10.5.55.7:5757 --nnodes 9 --node-rank 0 --tp-size 72 --dp-size 72 --enable-dp-attention "
    "--decode-log-interval 1 --enable-deepep-moe --page-size 1 --host 0.0.0.0 --trust-remote-code "
    "--moe-dense-tp-size 1 --enable-dp-lm-head --disable-radix-cache --watchdog-timeout 1000000 "
    "--enable-two-batch-overlap --deepep-mode low_latency --mem-fraction-static 0.835 --max-running-requests 18432 "
    "--context-length 4500 --init-expert-location YOUR_PATH --ep-num-redundant-experts 32 --cuda-graph-bs 256")
DEEPEP = {"--enable-deepep-moe": ["--moe-a2a-backend", "all2all"], "--deepep-config": []}  # DeepEP -> all2all
SGLANG_ENV = {"--ep-max-tokens-per-rank": "256"}  # decode: SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=256


def replace(argv: list[str], changes: dict[str, list[str]]) -> list[str]:
    """argv with each flag in `changes` (which must be there) replaced by its list: [] drops it."""
    out, seen, i = [], set(), 0
    while i < len(argv):
        flag, j = argv[i], i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        if flag in changes:
            seen.add(flag)
            out += changes[flag]
        else:
            out += argv[i:j]
        i = j
    assert seen == set(changes), f"not in the command: {set(changes) - seen}"
    return out


def all2all(argv: list[str]) -> dict[str, list[str]]:
    """The changes that replace DeepEP by all2all in argv."""
    return {flag: to for flag, to in DEEPEP.items() if flag in argv}


def parse(argv: list[str]) -> ServerArgs:
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


@pytest.mark.parametrize("command", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_every_flag_parses_at_sglangs_values_once_deepep_is_all2all(command):
    argv = shlex.split(command)
    if "deepep" in REFUSED_BACKENDS:  # DeepEP is refused by name, with what to use instead
        with pytest.raises(ValueError, match="--enable-deepep-moe: .*use --moe-a2a-backend all2all"):
            parse(argv)
    args = parse(replace(argv, all2all(argv)))
    assert args.moe_a2a_backend == "all2all" and args.enable_dp_lm_head and args.moe_dense_tp_size == 1
    assert args.trust_remote_code and args.decode_log_interval == 1 and args.watchdog_timeout == 1e6
    assert (args.tp_size, args.dp_size) in ((32, 32), (72, 72)) and args.disaggregation_ib_device == "mlx5_1"


# ---------------------------------------------------------------- the scaled pair behind sglang-router
NEW_TOKENS = 8


def scaled(command: str, model: str, dump: Path) -> tuple[list[str], int, int | None]:
    """The command at 2 CPU ranks on the tiny model: (argv, HTTP port, bootstrap port or None)."""
    argv = shlex.split(command)
    port = free_port()
    changes = {
        **all2all(argv),
        "--model-path": ["--model-path", model],
        "--disaggregation-ib-device": [],  # no InfiniBand device: Mooncake's TCP
        "--dist-init-addr": ["--dist-init-addr", f"127.0.0.1:{free_port()}"],
        "--nnodes": ["--nnodes", "1"],
        "--tp-size": ["--tp-size", "2"],
        "--dp-size": ["--dp-size", "2"],
        "--context-length": ["--context-length", "4096"],  # the embedded model's positions
        "--init-expert-location": ["--init-expert-location", str(dump)],
    }
    if "--max-total-tokens" in argv:
        changes["--max-total-tokens"] = ["--max-total-tokens", "8192"]
    argv = replace(argv, changes) + ["--port", str(port)]
    boot = None
    if "prefill" in argv:
        boot = free_port()
        argv += ["--disaggregation-bootstrap-port", str(boot)]
    else:
        argv += [f for kv in SGLANG_ENV.items() for f in kv]
    return argv, port, boot


def _serve(argv: list[str], port: int, boot: int | None, log: Path) -> Server:
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "serve", *argv], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log, boot)
    try:
        wait_healthy(proc, server.url, log, timeout=240)
    except BaseException:
        server.kill9()
        raise
    return server


@pytest.fixture(scope="module")
def sglang_pd(tmp_path_factory):
    """One PD pair from SGLang's commands behind sglang-router, for the module: (router URL, model, servers)."""
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (it is in the test extra)")
    from moeserve.models.default_model import default_model_path
    from tests.disagg.test_pd_router import _start_router

    tmp = tmp_path_factory.mktemp("sglang_launch")
    model = default_model_path()
    rng = random.Random(6017)
    dump = tmp / "expert_distribution.pt"  # a recorder dump (SGLang's format): redundant experts planned from it
    torch.save({"logical_count": torch.tensor([[rng.randrange(1, 100) for _ in range(16)] for _ in range(3)])}, dump)
    servers: list[Server] = []
    router = None
    try:
        for command in (PREFILL, DECODE):
            argv, port, boot = scaled(command, model, dump)
            servers.append(_serve(argv, port, boot, tmp / f"{'prefill' if boot else 'decode'}.log"))
        router, url = _start_router(servers[0], servers[1], tmp)
        yield url, model, servers
    finally:
        if router is not None:
            stop_process(router)
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_sglang_commands_serve_behind_sglang_router(sglang_pd):
    url, model, (prefill, decode) = sglang_pd
    rng = random.Random(49)
    prompts = [[rng.randrange(2, 3072) for _ in range(rng.randrange(3, 60))] for _ in range(4)]
    ref = InProcessEngine(model_path=model, dtype="float32").run(
        prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    for ids, want in zip(prompts, ref, strict=True):
        r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want["output_ids"]
    info = httpx.get(decode.url + "/get_server_info", timeout=10).json()
    assert (info["moe_a2a_backend"], info["deepep_mode"], info["ep_max_tokens_per_rank"]) == (
        "all2all", "low_latency", 256)
    assert info["cuda_graph_bs"] == [256] and info["enable_dp_lm_head"] and info["enable_two_batch_overlap"]
    assert "decode step" in decode.log.read_text()  # --decode-log-interval 1: one line per decode step
