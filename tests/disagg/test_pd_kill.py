"""PD liveness with real servers: kill -9 one side while requests are in flight.

Decode killed: prefill drops and frees its transfers (found by the heartbeat; requests no decode had asked for yet
end at prefill's bootstrap timeout, 5 s here), no room is left in any state, the pool is empty after a cache flush,
and a restarted decode is served. Prefill killed: decode's requests that were still waiting for KV fail with
HTTP 503 and a message saying the prefill server stopped answering (a stream ends with an error event), found by
the heartbeat (3 s), not by a timeout (those are set to minutes here); decode keeps serving and works with a
restarted prefill. Every request that did finish has the colocated engine's tokens.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.disagg.pd_procs import pd_post, sse_events, start, start_all
from tests.disagg.test_pd_server import _reference

pytestmark = pytest.mark.slow

NEW = 8
SLOW_TIMEOUTS = ["--disaggregation-transfer-timeout", "300", "--disaggregation-waiting-timeout", "300"]
# decode waits minutes for a bootstrap; prefill's requests that no decode ever asked for (it died first) go in 5 s
DECODE_FLAGS = [*SLOW_TIMEOUTS, "--disaggregation-bootstrap-timeout", "300"]
PREFILL_FLAGS = [*SLOW_TIMEOUTS, "--disaggregation-bootstrap-timeout", "5"]
SP = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def _long_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(300, 400))] for _ in range(n)]


def _wait(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _failure(d: httpx.Response) -> str | None:
    """The error message of a failed request: a 503 before any output, or a stream's final error event."""
    if d.status_code == 503:
        return d.json()["error"]["message"]
    events = sse_events(d) if d.status_code == 200 else []
    if events and "error" in events[-1]:
        return events[-1]["error"]["message"]
    assert d.status_code == 200, d.text
    return None


def _pd_states(server) -> dict:
    loads = httpx.get(server.url + "/get_load", timeout=10).json()
    return {k: sum(x["disagg"]["states"][k] for x in loads) for k in loads[0]["disagg"]["states"]}


def test_kill9_either_side(tmp_path):
    prompts = _long_prompts(6, 3)
    ref = _reference(prompts)
    prefill, decode = start_all(tmp_path, ("prefill", *PREFILL_FLAGS), ("decode", *DECODE_FLAGS))
    pool = ThreadPoolExecutor(16)
    try:
        # --- decode dies with transfers in flight: prefill lets go of them
        futs = [pool.submit(pd_post, prefill, decode, "/generate", {"input_ids": p, "sampling_params": SP})
                for p in prompts]
        _wait(lambda: _pd_states(prefill)["prefilling"] >= 1, "decode never told prefill where to write")
        decode.kill9()
        for f in futs:
            f.result()
        _wait(lambda: sum(_pd_states(prefill).values()) == 0, "prefill kept rooms of a dead decode")
        assert httpx.post(prefill.url + "/flush_cache", timeout=10).status_code == 200
        load = httpx.get(prefill.url + "/get_load", timeout=10).json()[0]
        assert load["kv_used_tokens"] == 0, load
        assert "the decode server stopped answering" in prefill.log.read_text()

        # --- a restarted decode: served again, right tokens
        decode = start("decode", tmp_path, *DECODE_FLAGS)
        p, d = pd_post(prefill, decode, "/generate", {"input_ids": prompts[0], "sampling_params": SP})
        assert d.status_code == 200 and d.json()["output_ids"] == ref[0]["output_ids"]

        # --- prefill dies mid-transfer: decode fails those requests with 503, keeps serving
        def one(i: int):
            body = {"input_ids": prompts[i], "sampling_params": SP, "stream": i % 2 == 1}
            return pd_post(prefill, decode, "/generate", body)

        futs = [pool.submit(one, i) for i in range(len(prompts))]
        _wait(lambda: _pd_states(decode)["transferring"] + _pd_states(decode)["waiting"] >= 2,
              "decode never waited on two transfers")
        killed = time.monotonic()
        prefill.kill9()
        failed = 0
        for i, f in enumerate(futs):
            _, d = f.result()
            error = _failure(d)
            if error is not None:
                failed += 1
                # found by the heartbeat, or by a bootstrap lookup that was in flight when the prefill died
                assert "stopped answering" in error or "PD bootstrap failed" in error, d.text
            else:
                assert d.status_code == 200, d.text
                out = sse_events(d)[-1] if i % 2 else d.json()
                assert out["output_ids"] == ref[i]["output_ids"]
        waited = time.monotonic() - killed
        assert failed >= 1
        assert waited < 30, waited  # the heartbeat's 3 s, with room for a loaded machine; the timeouts are 300 s
        assert httpx.get(decode.url + "/health", timeout=10).status_code == 200
        _wait(lambda: sum(_pd_states(decode).values()) == 0, "decode kept rooms of a dead prefill")

        # --- a restarted prefill: decode serves again
        prefill = start("prefill", tmp_path, *PREFILL_FLAGS)
        p, d = pd_post(prefill, decode, "/generate", {"input_ids": prompts[1], "sampling_params": SP})
        assert d.status_code == 200 and d.json()["output_ids"] == ref[1]["output_ids"]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        prefill.stop()
        decode.stop()
