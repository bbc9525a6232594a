"""Build a model on a device and fill its weights from a safetensors checkpoint (or at random).

    model, config = load_model(server_args, device)
    draft = load_mtp(server_args, model, device)     # DeepSeek's MTP layer, the draft of speculative decoding

- The model is constructed on the 'meta' device (no memory), then every parameter is allocated once, directly
  on `device`, in the chosen dtype (router weights stay float32), and filled in place.
- Checkpoints: model.safetensors, or shards listed in model.safetensors.index.json (any *.safetensors when
  there is neither). Tensors are read lazily with safe_open; each rank reads only its part (its experts, its
  heads), so the whole checkpoint is never in memory.
- Before anything is read, every tensor's name and shape is checked against what the model expects (from the
  file headers): a missing, unexpected or mis-shaped tensor raises ValueError naming it and both shapes.
  Skipped: rotary inv_freq buffers and lm_head when the embeddings are tied (silently), MTP layers
  (model.layers.{num_hidden_layers}+, one log line): `load_mtp` reads those for speculative decoding.
- FP8 (DeepSeek's block FP8, core/quant_config.py): a checkpoint whose config.json says so, or any checkpoint with
  --quantization fp8, builds the model with FP8 layers (layers/quantization/fp8.py). An FP8 checkpoint's
  `weight_scale_inv` tensors load beside their weights (dtypes and values checked: models/fp8_loading.py); an
  unquantized one is quantized at load with the same recipe, on the device. Dummy weights of an FP8 model are drawn
  in float32 and quantized the same way.
- dtype: float32 / bfloat16 / float16, or auto = the checkpoint's dtype on CUDA and float32 on CPU (CPU bf16
  matmuls are slow and the CPU runs are for development and tests).
- load_format 'dummy': random weights of the real shapes, needing only config.json. Every checkpoint tensor is
  drawn from its own generator seeded by (random_seed, tensor name), so ranks holding different parts of a
  tensor agree; normal(0, 0.02), norms 1, e_score_correction_bias normal(0, 0.01).
"""

from __future__ import annotations

import json
import logging
import re
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from moeserve.args import ServerArgs
from moeserve.core.model_config import ModelConfig
from moeserve.core.quant_config import Fp8Config
from moeserve.kernels.fp8_quant import FP8_DTYPE
from moeserve.layers.quantization.fp8 import to_fp8
from moeserve.layers.weights import WeightSpec, model_weight_specs
from moeserve.models import fp8_loading
from moeserve.models.default_model import resolve_model_path
from moeserve.models.mtp import SHARED_COPIES, MTPModel, check_mtp_support, mtp_layer_prefix
from moeserve.models.options import ModelOptions, model_options
from moeserve.models.registry import get_model_class
from moeserve.parallel.state import get_parallel_state

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
DUMMY_STD = 0.02
DUMMY_BIAS_STD = 0.01


def load_model(server_args: ServerArgs, device: torch.device | str,
               show_progress: bool | None = None) -> tuple[nn.Module, ModelConfig]:
    """The model for this rank on `device`, weights loaded, in eval mode; and its config."""
    device = torch.device(device)
    path = resolve_model_path(server_args)
    config = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(server_args.dtype, config.dtype, device)
    if show_progress is None:
        show_progress = get_parallel_state().rank == 0
    fp8 = weight_quantization(server_args, config)

    start = time.perf_counter()
    model = build_model(config, model_options(server_args, config, device), device, dtype, fp8=fp8 is not None)
    specs = list(model_weight_specs(model))
    # the checkpoint tensors it reads, kept: finish_loading may fold some away (the shared experts fused into the
    # routed experts' slots), and a reader of the same checkpoint (bench one-batch's transformers) needs them all
    model.checkpoint_shapes = {s.key: s.shape for s in specs}
    if server_args.load_format == "dummy":
        fill_dummy(model, specs, server_args.random_seed, show_progress)
    else:
        load_safetensors(model, specs, Path(path), config, show_progress,
                         quantize_at_load=fp8 is not None and config.fp8 is None)
    finish_loading(model, device)
    n = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("Loaded %s (%s): %.3fB params, %.2f GiB, weights %s on %s in %.1f s", config.architecture,
                "dummy" if server_args.load_format == "dummy" else path, n / 1e9, nbytes / 2**30,
                weight_format(model), device, time.perf_counter() - start)
    return model, config


def weight_quantization(server_args: ServerArgs, config: ModelConfig) -> Fp8Config | None:
    """The FP8 format the model runs in (the checkpoint's, or --quantization fp8's), or None."""
    return config.fp8 or (Fp8Config() if server_args.quantization == "fp8" else None)


def weight_format(model: nn.Module) -> str:
    """What the weights are, for the log lines and /get_server_info: 'bfloat16', or 'fp8 e4m3 128x128 blocks
    (+ bfloat16)' where FP8 layers hold the linear and expert weights and the rest stays in the model's dtype."""
    dtypes = {p.dtype for p in model.parameters()}
    plain = sorted(str(d).removeprefix("torch.") for d in dtypes - {FP8_DTYPE, torch.float32}) or ["float32"]
    if FP8_DTYPE not in dtypes:
        return " + ".join(plain)
    return "fp8 e4m3 128x128 blocks (+ " + " + ".join(plain) + ")"


def resolve_dtype(name: str, config_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--dtype to a torch dtype: auto = the checkpoint's on CUDA, float32 on CPU."""
    if name == "auto":
        return config_dtype if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name!r}: choose auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def build_model(config: ModelConfig, options: ModelOptions | None, device: torch.device,
                dtype: torch.dtype, fp8: bool = False) -> nn.Module:
    """Construct on 'meta' (with FP8 layers if `fp8`), then allocate every parameter on `device` (uninitialized but
    for FP8 block padding, zeroed: the caller fills them, then calls finish_loading). FP8 weights stay e4m3."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, options)
        if fp8:
            to_fp8(model, dtype)
    allocate_parameters(model, device, dtype)
    return model


def allocate_parameters(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace each 'meta' parameter by an uninitialized one on `device` in `dtype` (router weights float32, FP8
    weights e4m3, FP8 block padding zeroed)."""
    for module in model.modules():
        keep_fp32 = getattr(module, "fp32_params", ())
        padded = getattr(module, "padding_numel", {})
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            dt = torch.float32 if name in keep_fp32 else p.dtype if p.dtype == FP8_DTYPE else dtype
            alloc = torch.zeros if padded.get(name) else torch.empty
            module._parameters[name] = nn.Parameter(alloc(p.shape, dtype=dt, device=device), requires_grad=False)


def finish_loading(model: nn.Module, device: torch.device) -> None:
    """Once the weights are in: each module's device-specific layouts and state (`process_weights_after_loading`),
    children before their parents (an MoE layer reads the kernel choice its experts made), then eval mode."""
    for module in reversed(list(model.modules())):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(device)
    model.eval()


# ----------------------------------------------------------------------
# safetensors


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that are not there: {', '.join(absent)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path} (PyTorch .bin checkpoints are not supported)")
    return files


def read_headers(files: Iterable[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """key -> (file, shape, safetensors dtype such as 'BF16' or 'F8_E4M3') from the headers (no tensor data)."""
    from safetensors import safe_open

    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                found[key] = (file, tuple(part.get_shape()), part.get_dtype())
    return found


def _skipped(key: str, config: ModelConfig) -> bool:
    """Checkpoint tensors we knowingly do not use."""
    if key.endswith("rotary_emb.inv_freq") or key.endswith(".inv_freq"):
        return True
    if _is_mtp(key, config):
        return True
    return config.tie_word_embeddings and key == "lm_head.weight"


def _is_mtp(key: str, config: ModelConfig) -> bool:
    m = _LAYER_KEY.match(key)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers


def check_checkpoint(specs: list[WeightSpec], found: dict[str, tuple[Path, tuple[int, ...], str]],
                     config: ModelConfig, where: str, skipped: Callable[[str], bool] | None = None) -> None:
    """Raise ValueError listing every missing, unexpected and mis-shaped tensor. skipped: the checkpoint keys not
    read (default: the main model's `_skipped`)."""
    skipped = skipped or (lambda key: _skipped(key, config))
    expected: dict[str, tuple[int, ...]] = {}
    for s in specs:
        expected.setdefault(s.key, s.shape)
    problems = []
    for key, shape in expected.items():
        if key not in found:
            problems.append(f"missing tensor {key!r} (expected shape {shape})")
        elif found[key][1] != shape:
            problems.append(f"tensor {key!r} has shape {found[key][1]} in the checkpoint, expected {shape}")
    for key, (_, shape, _) in found.items():
        if key not in expected and not skipped(key):
            hint = ""
            if fp8_loading.is_scale_key(key):
                hint = (" (an FP8 scale of a layer this model does not quantize)" if config.fp8 else
                        " (an FP8 scale, but config.json has no FP8 quantization_config)")
            problems.append(f"unexpected tensor {key!r} (shape {shape}){hint}")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"checkpoint {where} does not match {config.architecture} as configured in its config.json "
                         f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:20]) + more)


def load_safetensors(model: nn.Module, specs: list[WeightSpec], path: Path, config: ModelConfig,
                     show_progress: bool = True, quantize_at_load: bool = False,
                     found: dict[str, tuple[Path, tuple[int, ...], str]] | None = None,
                     skipped: Callable[[str], bool] | None = None) -> None:
    """Check the checkpoint against `specs`, then copy each rank-local part into its parameter. quantize_at_load:
    the checkpoint is unquantized and the model's FP8 layers quantize their weights as they load. found: the
    headers, if read already; skipped: see check_checkpoint (the MTP layer's load reads its layer only)."""
    from safetensors import safe_open

    found = found if found is not None else read_headers(checkpoint_files(path))
    params = dict(model.named_parameters())
    quantized = fp8_loading.quantized_keys(specs, params)
    check_checkpoint(fp8_loading.scale_specs_absent(specs) if quantize_at_load else specs, found, config, str(path),
                     skipped)
    if quantized and not quantize_at_load:
        fp8_loading.check_fp8_dtypes(specs, {k: v[2] for k, v in found.items()}, quantized, str(path))
    if skipped is None:
        _log_mtp_skipped(found, config)
    by_file: dict[Path, list[WeightSpec]] = defaultdict(list)
    for s in specs:
        if s.param is not None:
            by_file[found[fp8_loading.weight_key(s.key) if quantize_at_load else s.key][0]].append(s)
    written: dict[str, int] = defaultdict(int)
    with tqdm(total=sum(map(len, by_file.values())), desc="Loading safetensors", unit="tensor",
              disable=not show_progress) as bar:
        for file, file_specs in sorted(by_file.items()):
            with safe_open(str(file), framework="pt") as f:
                reader = fp8_loading.QuantizingReader(lambda key, f=f: f.get_tensor(key).to(_device(params)))
                for s in file_specs:
                    if quantize_at_load and s.key in quantized:
                        full = reader.get(s.key)
                        t = full[s.src] if s.src else full
                    else:
                        t = f.get_slice(s.key)[s.src] if s.src else f.get_tensor(s.key)
                        if fp8_loading.is_scale_key(s.key):
                            fp8_loading.check_scale_values(s.key, t)
                    _copy_part(params, s, t, written)
                    bar.update(1)
    _check_written(model, params, written)


def _device(params: dict[str, nn.Parameter]) -> torch.device:
    return next(iter(params.values())).device


def _copy_part(params: dict[str, nn.Parameter], s: WeightSpec, t: torch.Tensor, written: dict[str, int]) -> None:
    dst = params[s.param].data[s.dst] if s.dst else params[s.param].data
    assert dst.shape == t.shape, f"{s.key}: slice {tuple(t.shape)} does not fit {tuple(dst.shape)}"
    dst.copy_(t)
    written[s.param] += t.numel()


def _log_mtp_skipped(found: dict[str, tuple[Path, tuple[int, ...], str]], config: ModelConfig) -> None:
    mtp = [k for k in found if _is_mtp(k, config)]
    if mtp:
        layers = sorted({int(_LAYER_KEY.match(k).group(1)) for k in mtp})
        logger.info("Skipping %d tensors of the multi-token-prediction layer(s) %s (read only for speculative "
                    "decoding)", len(mtp),
                    ", ".join(f"model.layers.{i}" for i in layers))


# ----------------------------------------------------------------------
# the MTP layer (speculative decoding's draft)

# the config fields the draft checkpoint must share with the target's (its MTP layer plugs into the target)
_DRAFT_SHAPE_FIELDS = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                       "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                       "num_experts", "moe_intermediate_size", "num_shared_experts", "intermediate_size")


def load_mtp(server_args: ServerArgs, target: nn.Module, device: torch.device | str,
             show_progress: bool | None = None) -> MTPModel:
    """DeepSeek's MTP layer over `target` (models/mtp.py) on `device`, with the target's options (its dispatcher,
    kernels, shared-experts fusion), weights loaded, in the target's dtype: from
    --speculative-draft-model-path, else from the target's own checkpoint; bf16 or FP8 as that checkpoint is (or
    --quantization fp8). Raises ValueError where the model has no MTP layer or its tensors are absent."""
    device = torch.device(device)
    path, config, found = mtp_checkpoint(server_args, target.config)
    if show_progress is None:
        show_progress = get_parallel_state().rank == 0
    dtype = target.model.embed_tokens.weight.dtype
    fp8 = weight_quantization(server_args, config)
    start = time.perf_counter()
    with torch.device("meta"):
        mtp = MTPModel(config, target.options, target)
        if fp8:
            to_fp8(mtp, dtype)
    allocate_parameters(mtp, device, dtype)
    specs = list(model_weight_specs(mtp))
    if server_args.load_format == "dummy":
        fill_dummy(mtp, specs, server_args.random_seed, show_progress)
    else:
        prefix = mtp.prefix + "."
        load_safetensors(mtp, specs, Path(path), config, show_progress,
                         quantize_at_load=fp8 is not None and config.fp8 is None, found=found,
                         skipped=lambda key: not key.startswith(prefix) or key.removeprefix(prefix) in SHARED_COPIES)
    finish_loading(mtp, device)
    n = sum(p.numel() for p in mtp.parameters())
    logger.info("Loaded the multi-token-prediction layer %s of %s: %.3fB params (embedding and head shared with the "
                "target), weights %s in %.1f s", mtp.prefix, path, n / 1e9, weight_format(mtp),
                time.perf_counter() - start)
    return mtp


def mtp_checkpoint(server_args: ServerArgs, target: ModelConfig
                   ) -> tuple[str, ModelConfig, dict[str, tuple[Path, tuple[int, ...], str]] | None]:
    """(path, config, headers) of the checkpoint the MTP layer is read from (--speculative-draft-model-path, else
    the target's), checked before anything loads (the server calls it at start): the family has MTP, config.json
    declares the layer, and the tensors under model.layers.{num_hidden_layers} are there (headers None: dummy
    weights). ValueError saying what is missing."""
    target_path = resolve_model_path(server_args)
    path = server_args.speculative_draft_model_path or target_path
    config = target if path == target_path else _draft_config(path, target)
    check_mtp_support(config)
    if server_args.load_format == "dummy":
        return path, config, None
    found = read_headers(checkpoint_files(Path(path)))
    prefix = mtp_layer_prefix(config) + "."
    if not any(key.startswith(prefix) for key in found):
        raise ValueError(f"checkpoint {path} has no tensors of the multi-token-prediction layer {prefix}* (its "
                         f"config.json declares num_nextn_predict_layers {config.num_mtp_layers}): speculative "
                         "decoding drafts with them; use a checkpoint that keeps the MTP layer (DeepSeek-V3 and R1 as "
                         "published), or point --speculative-draft-model-path at one")
    return path, config, found


def _draft_config(path: str, target: ModelConfig) -> ModelConfig:
    """The config of a --speculative-draft-model-path checkpoint, checked against the target's."""
    cfg = Path(path) / "config.json"
    archs = json.loads(cfg.read_text()).get("architectures") or [] if cfg.is_file() else []
    if any("NextN" in a for a in archs):
        raise ValueError(f"--speculative-draft-model-path {path}: {archs[0]} (an export of the MTP layer alone, as "
                         "model.layers.0 of a one-layer model) is not read; give a checkpoint of the target's config "
                         f"that keeps the layer where DeepSeek publishes it (model.layers.{target.num_hidden_layers}), "
                         "or leave the flag unset to draft with the target's own MTP layer")
    config = ModelConfig.from_pretrained(path)
    differ = [f"{f} {getattr(config, f)} (target: {getattr(target, f)})" for f in _DRAFT_SHAPE_FIELDS
              if getattr(config, f) != getattr(target, f)]
    if differ:
        raise ValueError(f"--speculative-draft-model-path {path} is not a checkpoint of the target's model: "
                         + ", ".join(differ))
    return config


# ----------------------------------------------------------------------
# dummy weights


def fill_dummy(model: nn.Module, specs: list[WeightSpec], seed: int, show_progress: bool = True) -> None:
    """Random weights of the real shapes, identical on every rank for the parts they share. FP8 layers' weights are
    drawn in float32 and quantized with the recipe (their scales come from that)."""
    params = dict(model.named_parameters())
    quantized = fp8_loading.quantized_keys(specs, params)
    shapes = {s.key: s.shape for s in specs}
    device = _device(params)
    reader = fp8_loading.QuantizingReader(lambda key: dummy_tensor(key, shapes[key], torch.float32, device, seed))
    written: dict[str, int] = defaultdict(int)
    needed = [s for s in specs if s.param is not None]
    for s in tqdm(needed, desc="Dummy weights", unit="tensor", disable=not show_progress):
        p = params[s.param]
        full = reader.get(s.key) if s.key in quantized else dummy_tensor(s.key, s.shape, p.dtype, p.device, seed)
        _copy_part(params, s, full[s.src] if s.src else full, written)
    _check_written(model, params, written)


def dummy_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 seed: int) -> torch.Tensor:
    """The dummy value of checkpoint tensor `key`: drawn from its own generator seeded by (seed, key) on `device`,
    so every rank, and the EPLB weight source later, draws the same numbers. Drawn in float32, then cast: torch's
    normal_ draws another sequence in bf16 than in float32 for some sizes (1,000 values on CPU), so a tensor held
    in float32 by one reader (the router's weight) and in the model's dtype by another must not depend on it."""
    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 63))
    std = DUMMY_BIAS_STD if key.endswith("e_score_correction_bias") else DUMMY_STD
    full = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
    return full if dtype == torch.float32 else full.to(dtype)


def _check_written(model: nn.Module, params: dict[str, nn.Parameter], written: dict[str, int]) -> None:
    padding = {f"{prefix}.{name}" if prefix else name: count for prefix, m in model.named_modules()
               for name, count in getattr(m, "padding_numel", {}).items()}
    unfilled = [n for n, p in params.items() if written.get(n, 0) + padding.get(n, 0) != p.numel()]
    assert not unfilled, f"parameters not (exactly) filled by the checkpoint: {unfilled[:10]}"
