"""Profile decode steps of the DeepSeek-V2-Lite-shaped dummy model on the GPU: where does a step's time go?

A shim over `moeserve bench one-batch --profile` (distinct random prompts per request, so the experts are used as
in serving; this script once gave every request the same prompt, which touched 6 of 64 experts and made a step look
twice as fast). Usage: python3 scripts/gpu/profile_decode.py [BATCH_SIZE ...] (default 64); traces in profiles/.
"""

import sys

from moeserve.bench.one_batch import main

sizes = sys.argv[1:] or ["64"]
raise SystemExit(main(["--model-path", "benchmarks/configs/deepseek-v2-lite", "--load-format", "dummy",
                       "--dtype", "bfloat16", "--context-length", "4096", "--mem-fraction-static", "0.5",
                       "--max-running-requests", str(max(int(s) for s in sizes)), "--input-len", "128",
                       "--output-len", "64", "--batch-size", *sizes, "--profile"]))
