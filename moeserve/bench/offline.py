"""`python -m moeserve.bench.offline`: end-to-end throughput of the offline Engine over one batch of random prompts.

The Engine starts its rank processes as a server would (ServerArgs flags: --tp-size, --enable-dp-attention,
--dp-size, --moe-a2a-backend, ...), then `--num-prompts` prompts of `--input-len` random token ids are submitted at
once (greedy, ignore_eos, `--output-len` new tokens each) and timed from submission to the last output. A smaller
warm-up batch runs first (not timed). Prints requests, tokens and total / input / output tokens per second; with
--result-file appends one JSON line. With --json-schema every output is constrained to the schema (structured
outputs): a request then ends where its grammar ends (at most --output-len tokens), and the tokens per second count
the tokens it wrote.

With DP attention the DP controller spreads the batch over the attention groups, so `--num-prompts` is the total
batch whatever the number of ranks.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

from moeserve.args import ServerArgs
from moeserve.bench.results import append_results
from moeserve.models.default_model import resolve_model_path


def run(args: ServerArgs, num_prompts: int, input_len: int, output_len: int, seed: int, warmup: int,
        json_schema: str | None = None) -> dict:
    from moeserve.server.engine import Engine

    kwargs = {k: v for k, v in vars(args).items() if k != "model_path"}
    t_start = time.perf_counter()
    eng = Engine(model_path=args.model_path, **kwargs)
    startup_s = time.perf_counter() - t_start
    try:
        vocab = eng.client.vocab_size
        rng = random.Random(seed)
        params = dict(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        if json_schema is not None:
            params["json_schema"] = json_schema
        if warmup:
            eng.generate(input_ids=[[rng.randrange(5, vocab) for _ in range(input_len)] for _ in range(warmup)],
                         sampling_params={**params, "max_new_tokens": min(output_len, 4)})
        prompts = [[rng.randrange(5, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        dur = time.perf_counter() - t0
        loads = eng.get_load()
    finally:
        eng.shutdown()
    n_in = num_prompts * input_len
    n_out = sum(len(o["output_ids"]) for o in outs)
    assert n_out == num_prompts * output_len or (json_schema and n_out <= num_prompts * output_len), n_out
    return {"tp_size": args.tp_size, "dp_size": args.num_dp_groups,
            "moe_a2a_backend": args.moe_a2a_backend, "deepep_mode": args.deepep_mode,
            "json_schema": json_schema is not None,
            "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "duration_s": dur, "startup_s": startup_s, "input_tokens": n_in, "output_tokens": n_out,
            "total_tok_s": (n_in + n_out) / dur, "input_tok_s": n_in / dur, "output_tok_s": n_out / dur,
            "groups_cached_tokens": [x.num_cached_tokens for x in loads],
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeserve.bench.offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-prompts", type=int, default=4, help="Untimed prompts first (0: none).")
    p.add_argument("--result-file", default=None, help="Append one JSON line.")
    p.add_argument("--json-schema", default=None,
                   help="Constrain every output to this JSON schema: a file, or the schema itself (starting with {).")
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)  # takes the ServerArgs fields, leaves the benchmark's own flags
    resolve_model_path(args)
    schema = ns.json_schema
    if schema is not None and not schema.lstrip().startswith("{"):
        with open(schema, encoding="utf-8") as f:
            schema = f.read()
    r = run(args, ns.num_prompts, ns.input_len, ns.output_len, ns.seed, ns.warmup_prompts, schema)
    constrained = ", JSON schema" if schema else ""
    print(f"tp {r['tp_size']} dp {r['dp_size']} {r['moe_a2a_backend']}/{r['deepep_mode']}: {r['num_prompts']} prompts "
          f"x ({r['input_len']} in + {r['output_len']} out{constrained}) in {r['duration_s']:.2f} s: total "
          f"{r['total_tok_s']:.1f} tok/s, input {r['input_tok_s']:.1f} tok/s, output {r['output_tok_s']:.1f} tok/s "
          f"(start-up {r['startup_s']:.1f} s)", flush=True)
    append_results(ns.result_file, [r])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
