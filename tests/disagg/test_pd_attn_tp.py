"""Attention TP inside a PD side, with real servers: the PD state machine runs on every rank of an attention group,
the leader talks to the peer side.

MLA (the embedded model): one prefill server with attention TP 2 serves two decode servers at once, one with
attention TP 2 (the prefill leader reads the latent once and writes it to both decode ranks) and one with a single
rank. GQA (tiny Qwen3-MoE, 2 KV heads: one per rank at TP 2): prefill rank r writes its heads to decode rank r;
a decode server of another attention TP size is refused at bootstrap with a message that says why, and the
prefill server keeps serving. Greedy tokens and logprobs equal the colocated single-rank engine's. /health_generate
answers 200 on every PD server (it runs alone, without a peer).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moeserve.rank.sampling_params import SamplingParams
from tests.disagg.pd_procs import Server, pd_post, sse_events, start
from tests.rank.inprocess import InProcessEngine

pytestmark = pytest.mark.slow

NEW = 6


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _reference(model_path: str, prompts: list[list[int]]) -> list[dict]:
    eng = InProcessEngine(model_path=model_path, dtype="float32", page_size=4, chunked_prefill_size=16,
                          skip_tokenizer_init=True)
    return eng.run(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True),
                   return_logprob=True)


def _serve_both(prefill: Server, decodes: list[Server], prompts: list[list[int]]) -> list[tuple]:
    """Every prompt at once, prompt i to decodes[i % len(decodes)]; odd ones streamed."""
    sp = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}

    def one(i: int):
        body = {"input_ids": prompts[i], "sampling_params": sp, "return_logprob": True, "stream": i % 2 == 1}
        return pd_post(prefill, decodes[i % len(decodes)], "/generate", body)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _check(answers: list[tuple], ref: list[dict]) -> None:
    for i, (p, d) in enumerate(answers):
        assert p.status_code == 200 and d.status_code == 200, (i, p.text, d.text)
        out = sse_events(d)[-1] if i % 2 else d.json()
        assert out["output_ids"] == ref[i]["output_ids"], i
        lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx(ref[i]["logprobs"], abs=1e-4), i


def _transfer_bytes(server: Server) -> int:
    return sum(x["disagg"]["transfer_bytes"] for x in httpx.get(server.url + "/get_load", timeout=10).json())


def test_mla_prefill_tp2_feeds_decode_tp2_and_tp1(tmp_path):
    from moeserve.models.default_model import default_model_path

    prompts = _prompts(8, 11, 400)
    ref = _reference(default_model_path(), prompts)
    with ThreadPoolExecutor(3) as pool:  # start-up in parallel
        futs = [pool.submit(start, "prefill", tmp_path, "--tp-size", "2"),
                pool.submit(start, "decode", tmp_path, "--tp-size", "2"),
                pool.submit(start, "decode", tmp_path)]
        servers = [f.result() for f in futs]
    prefill, d2, d1 = servers
    try:
        _check(_serve_both(prefill, [d2, d1], prompts), ref)
        # each decode rank got the whole latent: per prompt page, the TP-2 server received twice the bytes of
        # the single-rank one (every prompt page travels: decode holds no prefix of its own)
        pages = [sum(-(-len(prompts[i]) // 4) for i in range(k, len(prompts), 2)) for k in (0, 1)]
        got2, got1 = _transfer_bytes(d2), _transfer_bytes(d1)
        assert got1 > 0 and got1 % pages[1] == 0 and got2 == 2 * pages[0] * (got1 // pages[1]), (got2, got1)
        assert _transfer_bytes(prefill) == got2 + got1
        info = httpx.get(d2.url + "/get_server_info", timeout=10).json()
        assert info["disaggregation_mode"] == "decode" and info["tp_size"] == 2
        for s in servers:  # each side generates its health token alone, with no peer
            r = httpx.get(s.url + "/health_generate", timeout=60)
            assert r.status_code == 200, r.text
    finally:
        for s in servers:
            s.stop()


def test_gqa_heads_split_over_equal_attention_tp(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    prompts = _prompts(6, 12, 200)
    ref = _reference(path, prompts)
    flags = ("--model-path", path, "--skip-tokenizer-init")
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(start, "prefill", tmp_path, *flags, "--tp-size", "2"),
                pool.submit(start, "decode", tmp_path, *flags, "--tp-size", "2"),
                pool.submit(start, "decode", tmp_path, *flags)]
        servers = [f.result() for f in futs]
    prefill, d2, d1 = servers
    try:
        _check(_serve_both(prefill, [d2], prompts), ref)
        sp = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        p, d = pd_post(prefill, d1, "/generate", {"input_ids": prompts[0], "sampling_params": sp})
        assert d.status_code == 500 and "attention TP 2, this decode server 1" in d.text, d.text
        assert p.status_code >= 500 and "cancel" in p.text, p.text
        _check(_serve_both(prefill, [d2], prompts[:2]), ref[:2])  # the pair still serves
    finally:
        for s in servers:
            s.stop()
