"""Record the default model's expert load on held-out text, prefill and decode apart (docs/eplb.md's walk-through).

    moeserve serve --expert-distribution-recorder-mode per_pass &
    python scripts/record_default_model_load.py --url http://127.0.0.1:30000

Two recordings through the server's recorder endpoints, written to $MOESERVE_CACHE/expert_distribution/:
prefill.pt, every held-out window (moeserve/models/default_heldout.py) prefilled and scored with
max_new_tokens 0; decode.pt, the first 16 tokens of each window as a prompt and 128 greedy new tokens, so that
almost all routed tokens are decode steps. Prints each file's path and its tokens per layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeserve.models.default_heldout import shipped_windows  # noqa: E402

DECODE_PROMPT, DECODE_NEW = 16, 128


def record(client: httpx.Client, name: str, bodies: list[dict]) -> str:
    client.post("/start_expert_distribution_record").raise_for_status()
    for body in bodies:
        client.post("/generate", json=body).raise_for_status()
    client.post("/stop_expert_distribution_record").raise_for_status()
    r = client.post("/dump_expert_distribution_record", json={"name": name})
    r.raise_for_status()
    return r.json().get("path", name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    windows = shipped_windows()
    batches = [windows[i:i + 8] for i in range(0, len(windows), 8)]
    prefill = [{"input_ids": b, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": 0} for b in batches]
    decode = [{"input_ids": [w[:DECODE_PROMPT] for w in b],
               "sampling_params": {"max_new_tokens": DECODE_NEW, "temperature": 0, "ignore_eos": True}}
              for b in batches]
    with httpx.Client(base_url=args.url, timeout=600) as client:
        for name, bodies in (("prefill.pt", prefill), ("decode.pt", decode)):
            print(record(client, name, bodies))


if __name__ == "__main__":
    main()
