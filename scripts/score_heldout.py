"""Held-out perplexity of a served model through the HTTP API (/generate with prompt logprobs).

    moeserve serve &                                   # the shipped default model
    python scripts/score_heldout.py --url http://127.0.0.1:30000

It scores the windows of moeserve/models/default/heldout.txt (moeserve/models/default_heldout.py), tokenized
with the shipped tokenizer, as token ids: one /generate request per batch of windows, return_logprob with
logprob_start_len 0 and max_new_tokens 0. Any model that takes the shipped tokenizer's ids can be scored (the
random-weight model of the same shapes, for a baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeserve.models.default_heldout import perplexity, shipped_windows  # noqa: E402


def score(client: httpx.Client, windows: list[list[int]], batch: int = 8) -> list[list[float]]:
    """Per window, the log-probabilities of its tokens after the first."""
    out = []
    for i in range(0, len(windows), batch):
        part = windows[i:i + batch]
        r = client.post("/generate", json={"input_ids": part, "return_logprob": True, "logprob_start_len": 0,
                                           "sampling_params": {"max_new_tokens": 0}})
        r.raise_for_status()
        for res in r.json():
            out.append([lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    windows = shipped_windows()
    with httpx.Client(base_url=args.url, timeout=600) as client:
        lps = score(client, windows)
    n = sum(len(w) for w in lps)
    print(json.dumps({"windows": len(windows), "tokens": n, "perplexity": round(perplexity(lps), 3)}))


if __name__ == "__main__":
    main()
