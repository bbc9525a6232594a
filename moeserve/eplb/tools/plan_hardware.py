"""GPU presets for the step-time model: peak FLOP/s, HBM and network bandwidth of one GPU.

Numbers are vendor peaks for the SXM parts (dense, no sparsity). Network figures are per GPU and per
direction: NVLink is the GPU's share of the NVSwitch fabric; RDMA is one 400 Gb/s ConnectX-7 NIC per GPU
(50 GB/s), the usual H100/H800/H200 node (and the setup behind DeepEP's and SGLang's published numbers).
Any field can be overridden from the command line (`--gpu-fp8-tflops`, `--gpu-rdma-gbps`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's peaks: dense tensor FLOP/s, memory, and network bandwidth per direction."""

    name: str
    bf16_tflops: float  # dense BF16 tensor-core peak
    fp8_tflops: float  # dense FP8 tensor-core peak
    hbm_tbps: float  # HBM bandwidth, TB/s
    hbm_gb: float  # HBM capacity, GB
    nvlink_gbps: float  # NVLink bandwidth per direction, GB/s
    rdma_gbps: float  # inter-node NIC bandwidth per GPU per direction, GB/s
    num_sms: int = 132


# H100 SXM5: 989 / 1979 TFLOP/s dense, 3.35 TB/s HBM3 80 GB, NVLink 4 at 900 GB/s bidirectional.
_H100 = GpuSpec("h100", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tbps=3.35, hbm_gb=80.0, nvlink_gbps=450.0,
                rdma_gbps=50.0)

GPU_PRESETS: dict[str, GpuSpec] = {
    "h100": _H100,
    # H800 SXM5: H100 compute and memory, NVLink cut to 400 GB/s bidirectional (DeepEP measures ~160 GB/s).
    "h800": replace(_H100, name="h800", nvlink_gbps=200.0),
    # H200 SXM: H100 compute, 4.8 TB/s HBM3e 141 GB.
    "h200": replace(_H100, name="h200", hbm_tbps=4.8, hbm_gb=141.0),
}

OVERRIDABLE = tuple(f.name for f in fields(GpuSpec) if f.name != "name")


def gpu_spec(name: str, **overrides: float | None) -> GpuSpec:
    """The preset `name` with any non-None overrides applied (field names of GpuSpec)."""
    key = name.lower()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(GPU_PRESETS)} (override fields by flag)")
    bad = set(overrides) - set(OVERRIDABLE)
    if bad:
        raise ValueError(f"unknown GPU fields {sorted(bad)}; known: {', '.join(OVERRIDABLE)}")
    return replace(GPU_PRESETS[key], **{k: v for k, v in overrides.items() if v is not None})
