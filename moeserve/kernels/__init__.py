"""moeserve's compute kernels. One idea per file; the layout every kernel follows (FP8 variants too):

    kernels/<op>.py             the public function `<op>(...)` that callers use, and `<op>_reference(...)`, the torch
                                version with the same signature (what runs on the CPU, and what tests compare with).
                                `<op>` picks: the Triton kernel for CUDA tensors where Triton imports (not while
                                torch.compile traces: the compiled graph takes the reference), else the reference.
    kernels/triton_ops/<op>.py  the @triton.jit kernel(s) and their launcher, again with the same signature. Imported
                                lazily (Triton is optional on CPU hosts); tests run them on the CPU under
                                TRITON_INTERPRET=1 (tests/kernels).
    kernels/configs/<op>/*.json tuned launch tables (moe_config.py reads them; benchmark/kernels/tune_moe.py
                                writes them), one file per (shape, dtype, device), keyed by the row count M.

The MoE kernels, in the order an MoE layer runs them (shapes at the interfaces):
    moe_route(topk_ids [T, k], E, align)         -> RoutePlan: counts [E], offsets [E + 1], dest [T*k], src [M]
                                                    (counting, no sort; pairs keep (token, slot) order per expert)
    moe_gemm(x [M, K], w [E, N, K], offsets, counts, silu=...)   contiguous layout grouped GEMM; silu=True treats
                                                    w as [gate; up] (N = 2I) and returns silu(gate) * up [M, I]
    moe_gemm_masked(x [E, C, K], w [E, N, K], masked_m [E], silu=...)   the same over the masked layout
    moe_combine(y [M, H], rows [T, k], weights [T, k])  -> [T, H]: sum_j weights[t, j] * y[rows[t, j]] (fp32 sum)
Other kernels: rms_norm.py (RMSNorm, optionally with the residual add fused); skinny_gemm.py (the dense layers'
x W^T at one to four rows: a GEMV at the memory's rate); mla_decode.py (MLA decode attention
over the latent cache); mla_rope_cache.py (MLA's latent write with its RMSNorm and rotary, fused; rotary.py holds
the rotary arithmetic it shares with layers/rotary.py).
CPU-only kernels (C++, not Triton), compiled per ISA (cpu_isa.py): cpu_experts.py, cpu_mla_decode.py,
cpu_latent_extend.py (MLA's absorbed extend, which layers/attention/latent_extend.py calls on the CPU),
cpu_skinny_gemm.py (the bf16 dense layers at one to four rows, which skinny_gemm.py calls on the CPU),
cpu_rms_norm.py (RMSNorm in bf16 and float32, which rms_norm.py calls on the CPU), cpu_mla_rope_cache.py (which mla_rope_cache.py
calls on the CPU) and cpu_moe_select.py (which moe_select.py calls on the CPU).
"""
