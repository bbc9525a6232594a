"""`moeserve bench pd`: its flags, its side-by-side table, and one real run (colocated beside PD over zmq through
sglang-router, on the embedded model) that stops every process it started."""

from __future__ import annotations

import json
import random
import socket

import pytest

from moeserve.bench import pd
from moeserve.bench.pd_report import side_by_side, transfer_summary


def test_flags_split_between_the_command_the_load_generator_and_the_servers():
    args, bench, serve = pd.parse_args(["--runs", "zmq", "colocated", "--num-prompts", "7", "--max-concurrency",
                                        "3", "--decode-flags=--max-running-requests 8", "--",
                                        "--dtype", "float32", "--page-size", "4"])
    assert args.runs == ["zmq", "colocated"] and args.decode_flags == "--max-running-requests 8"
    assert bench.num_prompts == 7 and bench.max_concurrency == 3 and bench.dataset == "random"
    assert serve == ["--dtype", "float32", "--page-size", "4"]


@pytest.mark.parametrize("argv", [
    ["--port", "30000"],  # the command starts its targets
    ["--base-url", "http://h:1"],
    ["--ready-timeout", "5"],  # it waits for its targets itself
    ["--api-key", "k"],
    ["--", "--api-key=k"],
    ["--decode-flags=--api-key k"],
    ["--", "--port", "1"],  # the servers' addresses and roles are its own
    ["--prefill-flags=--disaggregation-mode decode"],
    ["--", "--disaggregation-transfer-backend=zmq"],
    ["--runs", "zmq", "zmq"],
    ["--max-concurrency", "0"],
])
def test_refused_flags(argv, capsys):
    with pytest.raises(SystemExit) as e:
        pd.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def _fake_run(rng: random.Random, pd_side: bool) -> dict:
    def stats():
        return {k: rng.uniform(1, 500) for k in ("mean", "median", "std", "p90", "p99", "max")}

    summary = {"completed": rng.randint(5, 50), "failed": 0, "duration_s": rng.uniform(1, 9),
               "request_throughput": rng.uniform(1, 9), "output_throughput": rng.uniform(100, 900),
               "ttft_ms": stats(), "itl_ms": stats(), "tpot_ms": stats(), "e2e_ms": stats()}
    run = {"summary": summary, "loadavg_1m": [rng.uniform(0, 4), rng.uniform(0, 4)]}
    if pd_side:
        prefill = {"transfers": rng.randint(5, 50), "transfer_bytes": rng.randint(10**6, 10**9),
                   "transfer_seconds": rng.uniform(0.5, 5), "write_seconds": rng.uniform(0.1, 0.5), "failed": 0}
        run["transfer"] = {"prefill": prefill, "summary": transfer_summary(prefill, summary["duration_s"])}
    return run


def test_side_by_side_table():
    rng = random.Random()
    results = {"colocated": _fake_run(rng, False), "zmq": _fake_run(rng, True), "mooncake": _fake_run(rng, True)}
    bench = pd.parse_args(["--num-prompts", "9", "--max-concurrency", "4"])[1]
    lines = side_by_side(results, bench).splitlines()
    assert lines[0].startswith("PD vs colocated: 9 prompts") and "concurrency 4" in lines[0]
    assert lines[1].split() == ["colocated", "PD", "zmq", "PD", "mooncake"]
    rows = {line[:32].strip(): line[32:].split() for line in lines[2:]}
    for title, key, stat in (("TTFT p99 (ms)", "ttft_ms", "p99"), ("ITL p50 (ms)", "itl_ms", "median")):
        assert rows[title] == [f"{r['summary'][key][stat]:.2f}" for r in results.values()]
    assert rows["Output throughput (tok/s)"] == [f"{r['summary']['output_throughput']:.2f}"
                                                 for r in results.values()]
    assert rows["KV transfers"] == ["-"] + [str(results[n]["transfer"]["prefill"]["transfers"])
                                            for n in ("zmq", "mooncake")]
    for name, cell in zip(("zmq", "mooncake"), rows["KV GB/s inside the writes"][1:], strict=True):
        p = results[name]["transfer"]["prefill"]
        assert float(cell) == pytest.approx(p["transfer_bytes"] / p["write_seconds"] / 1e9, rel=0.01)
    for name, cell in zip(("zmq", "mooncake"), rows["KV latency incl. queue, mean ms"][1:], strict=True):
        p = results[name]["transfer"]["prefill"]
        assert float(cell) == pytest.approx(p["transfer_seconds"] / p["transfers"] * 1e3, abs=0.01)
    # No GB/s over the latency or the run: those measure queueing, not the link.
    assert [title for title in rows if "GB/s" in title] == ["KV GB/s inside the writes"]


def test_transfer_summary():
    s = transfer_summary({"transfers": 4, "transfer_bytes": 3 * 2**20, "transfer_seconds": 0.5,
                          "write_seconds": 0.25, "failed": 1}, 2.0)
    assert s == {"transfers": 4, "failed": 1, "mib": 3.0, "mean_latency_ms": 125.0, "mean_write_ms": 62.5,
                 "gb_s_while_writing": round(3 * 2**20 / 0.25 / 1e9, 6)}
    assert transfer_summary({"transfers": 0, "transfer_bytes": 0, "transfer_seconds": 0.0, "write_seconds": 0.0,
                             "failed": 0}, 1.0)["mean_latency_ms"] == 0.0


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_colocated_beside_pd_end_to_end(tmp_path, capsys):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (it is in the test extra)")
    out, logs = tmp_path / "pd.json", tmp_path / "logs"
    rc = pd.main(["--runs", "colocated", "zmq", "--num-prompts", "4", "--random-input-len", "24",
                  "--random-output-len", "6", "--random-range-ratio", "1", "--max-concurrency", "2",
                  "--warmup-requests", "2", "--disable-tqdm", "--server-timeout", "180", "--log-dir", str(logs),
                  "--output-file", str(out), "--", "--dtype", "float32", "--page-size", "4"])
    assert rc == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "PD vs colocated: 4 prompts" in printed and "PD zmq" in printed
    results = json.loads(out.read_text())["results"]
    for run in ("colocated", "zmq"):
        s = results[run]["summary"]
        assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 24
    t = results["zmq"]["transfer"]
    # the measured requests alone (the warm-up's are before the first reading), each prompt's KV once
    assert t["prefill"]["transfers"] == t["decode"]["transfers"] == 4
    assert t["prefill"]["transfer_bytes"] == t["decode"]["transfer_bytes"] > 0
    assert "colocated" not in results["zmq"] and "transfer" not in results["colocated"]
    # every server and the router are gone: none of the ports in their command lines answers
    ports = []
    for log in logs.iterdir():
        cmd = log.read_text().splitlines()[0].split()
        ports.append(int(cmd[cmd.index("--port") + 1]))
    assert len(ports) == 4 and not any(_port_open(p) for p in ports)
