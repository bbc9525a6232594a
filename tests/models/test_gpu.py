"""GPU checks (skipped without CUDA): our CUDA model equals our CPU model (itself checked against transformers),
bf16 grouped GEMM, and a DeepSeek-V2-Lite-shaped dummy model (15.7B params, bf16) loads and runs on one GPU.

Run on the GPU machine:  python3 -m pytest -o addopts="" -s tests/models/test_gpu.py
"""

from __future__ import annotations

import time

import pytest
import torch

from moeserve.args import ServerArgs
from moeserve.core.forward_batch import ForwardBatch, ForwardMode
from moeserve.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moeserve.kvcache.kv_pool import make_kv_pool
from moeserve.models.loader import load_model
from tests.checkpoints import write_config_only
from tests.models.harness import Runner, random_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", ["v3_groups", "v2_lite", "qwen3_moe", "mixtral_swa"])
def test_cuda_equals_cpu(name, tiny_checkpoint):
    path = tiny_checkpoint(name)
    cpu, gpu = Runner(path), Runner(path, device="cuda")
    prompts = [("a", random_tokens(9, 1)), ("b", random_tokens(3, 2)), ("c", random_tokens(14, 3))]
    torch.testing.assert_close(gpu.extend(prompts), cpu.extend(prompts), atol=1e-4, rtol=1e-4)
    for step in range(4):
        reqs = [(r, t) for (r, _), t in zip(prompts, random_tokens(3, 10 + step), strict=True)]
        torch.testing.assert_close(gpu.decode(reqs), cpu.decode(reqs), atol=1e-4, rtol=1e-4)


def test_grouped_gemm_bf16_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([0, 130, 7, 256, 1, 0, 64, 3], dtype=torch.int32)
    offsets = torch.zeros(9, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    x = torch.randn(int(offsets[-1]), 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16, generator=gen) * 512**-0.5
    out = grouped_gemm(x, w, offsets.cuda(), counts.cuda())
    ref = grouped_gemm_reference(x, w, offsets.cuda(), counts.cuda())
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_v2_lite_dummy_loads_and_runs(tmp_path):
    path = write_config_only("DeepSeek-V2-Lite", tmp_path)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model, config = load_model(ServerArgs(model_path=path, load_format="dummy"), "cuda")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 15.7e9 - 1) < 0.01 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    print(f"\nV2-Lite dummy: {n / 1e9:.2f}B params loaded in {load_s:.1f} s, "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")

    B, prompt, steps = 32, 256, 16
    pool = make_kv_pool(config, B * (prompt + steps) + 8, 1, torch.bfloat16, "cuda")
    slots = [list(range(1 + b * (prompt + steps), 1 + (b + 1) * (prompt + steps))) for b in range(B)]
    tokens = torch.randint(0, config.vocab_size, (B, prompt), generator=torch.Generator().manual_seed(0))
    batch = ForwardBatch.build(ForwardMode.EXTEND, tokens.flatten().tolist(), [prompt] * B, [prompt] * B,
                               [s for b in range(B) for s in slots[b][:prompt]],
                               [s for b in range(B) for s in slots[b][:prompt]], pool).to("cuda")
    with torch.inference_mode():
        model(batch)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = model(batch)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t
        assert logits.shape == (B, config.vocab_size) and torch.isfinite(logits).all()
        nxt = logits.argmax(-1).tolist()
        times = []
        for i in range(steps):
            length = prompt + i + 1
            batch = ForwardBatch.build(ForwardMode.DECODE, nxt, [length] * B, [1] * B,
                                       [slots[b][length - 1] for b in range(B)],
                                       [s for b in range(B) for s in slots[b][:length]], pool).to("cuda")
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits = model(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            assert torch.isfinite(logits).all()
            nxt = logits.argmax(-1).tolist()
    decode_s = sorted(times)[len(times) // 2]
    print(f"V2-Lite dummy: prefill {B}x{prompt} tokens {prefill_s * 1e3:.0f} ms "
          f"({B * prompt / prefill_s:.0f} tok/s); decode batch {B} median {decode_s * 1e3:.1f} ms/step "
          f"({B / decode_s:.0f} tok/s), no CUDA graphs")
