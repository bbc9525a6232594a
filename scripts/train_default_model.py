"""Train the embedded default model (moeserve/models/default/) on Python's standard library.

    python scripts/train_default_model.py --device cuda --steps 2000 --out /tmp/default
    python scripts/train_default_model.py --device cpu --steps 3 --batch-size 2 --seq-len 64 \\
        --corpus-dir tests/some_dir --vocab-size 320 --out /tmp/tiny       # a smoke run

The data is the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`): every *.py file
outside test suites, site-packages and bundled wheels, in path order. That is Python's own source code, its
comments and docstrings, and `pydoc_data/topics.py`, the language reference's text that `pydoc` prints; all of
it is under the PSF license, which allows redistribution. A file is held out (never trained on, neither the
tokenizer nor the model) when crc32 of its relative path is 0 mod HELDOUT_MOD; the shipped heldout.txt is the
beginning of those files.

The model is transformers' DeepseekV3ForCausalLM built from moeserve's default_config (MLA with q_lora,
noaux_tc sigmoid routing with e_score_correction_bias, 4 expert groups of which 2 are kept, top-4 of 16
routed experts plus one shared expert, one dense layer first). The correction bias is not learned by gradient;
it is moved after every step the way DeepSeek-V3's auxiliary-loss-free balancing does,
bias_e += gamma * sign(mean load - load_e), with a small gamma (default 1e-4, DeepSeek-V3 used 1e-3): over a
short run it pulls the worst experts in but leaves the skew that routing on real text has, which is what
`moeserve eplb analyze` is for. Everything is seeded and the deterministic kernels are asked for: on CPU two runs
give byte-identical files; on a GPU the atomics in index_add make the last bits of the weights differ.

It writes into --out: config.json, generation_config.json, model.safetensors (bf16; the router's weight and
bias fp32), tokenizer.json, tokenizer_config.json, heldout.txt and training.json (the command, the data, the
loss curve, the held-out perplexity with its unigram baseline, the expert loads, the time).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeserve.models.default_heldout import WINDOW, heldout_windows  # noqa: E402
from moeserve.models.default_model import (  # noqa: E402
    BOS_TOKEN,
    default_config,
    make_weights,
    tokenizer_config,
    train_tokenizer,
)

HELDOUT_MOD = 25
HELDOUT_CHARS = 40_000  # the shipped held-out sample: about 40 windows of WINDOW tokens
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "ensurepip", "__pycache__",
              "lib2to3", "turtledemo"}


# ----------------------------------------------------------------------
# data
def corpus_files(root: Path) -> list[Path]:
    """The *.py files under `root` that are not test suites or bundled third-party code, in path order."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in SKIP_PARTS or p.startswith("test_") for p in parts):
            continue
        files.append(path)
    return files


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELDOUT_MOD == 0


def read_corpus(root: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, heldout): lists of (relative path, text)."""
    train, heldout = [], []
    for path in corpus_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        (heldout if is_heldout(rel) else train).append((rel, text))
    if not train or not heldout:
        raise SystemExit(f"{root}: need both training and held-out files (found {len(train)} and {len(heldout)})")
    return train, heldout


def heldout_sample(heldout: list[tuple[str, str]], chars: int = HELDOUT_CHARS) -> str:
    """The beginning of every held-out file, up to `chars` in all (so every file is represented)."""
    share = max(1, chars // len(heldout))
    return "".join(text[:share] for _, text in heldout)[:chars]


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """[N] int64: every text's ids (the tokenizer prepends BOS), one after the other."""
    encodings = tokenizer.encode_batch(texts)
    return torch.tensor([t for enc in encodings for t in enc.ids], dtype=torch.int64)


# ----------------------------------------------------------------------
# model
def build_model(config: dict, seed: int) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    return model.float()


def moe_layers(model: torch.nn.Module, config: dict) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers[config["first_k_dense_replace"]:]]


def route(hidden: torch.Tensor, gate: torch.nn.Module, config: dict) -> torch.Tensor:
    """[T, k] expert ids that noaux_tc picks for hidden [..., H] (the same choice as the model's own gate)."""
    scores = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), gate.weight.float()).sigmoid()
    biased = scores + gate.e_score_correction_bias
    groups, per_group = config["n_group"], config["n_routed_experts"] // config["n_group"]
    group_scores = biased.view(-1, groups, per_group).topk(2, dim=-1).values.sum(-1)
    kept = group_scores.topk(config["topk_group"], dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    biased = biased.masked_fill(~mask.repeat_interleave(per_group, dim=1), float("-inf"))
    return biased.topk(config["num_experts_per_tok"], dim=-1).indices


class LoadCounter:
    """Counts, per MoE layer, the tokens routed to each expert while `active` (hooks on the MoE modules)."""

    def __init__(self, layers: list[torch.nn.Module], config: dict, device: torch.device):
        self.layers, self.active = layers, True
        self.counts = torch.zeros(len(layers), config["n_routed_experts"], device=device)
        for i, mlp in enumerate(layers):
            mlp.register_forward_pre_hook(self._hook(i, config))

    def _hook(self, i: int, config: dict):
        def hook(module, args):
            if self.active:
                with torch.no_grad():
                    ids = route(args[0], module.gate, config)
                    self.counts[i] += torch.bincount(ids.flatten(), minlength=self.counts.shape[1])
        return hook

    def take(self) -> torch.Tensor:
        out, self.counts = self.counts, torch.zeros_like(self.counts)
        return out


def update_bias(layers: list[torch.nn.Module], load: torch.Tensor, gamma: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: under-loaded experts' bias up, over-loaded ones' down."""
    with torch.no_grad():
        for mlp, row in zip(layers, load, strict=True):
            mlp.gate.e_score_correction_bias += gamma * torch.sign(row.mean() - row)


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict (float32, on the CPU) with the fused expert tensors split into one tensor per
    expert projection, under DeepSeek-V3's checkpoint names."""
    out = {}
    for name, tensor in state.items():
        t = tensor.detach().float().cpu()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def checkpoint_dtypes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 except the router (fp32, as the model computes it), contiguous."""
    router = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    return {k: (v if k.endswith(router) else v.to(torch.bfloat16)).contiguous() for k, v in tensors.items()}


def export_state(model: torch.nn.Module, config: dict) -> dict[str, torch.Tensor]:
    """The trained weights under the checkpoint names moeserve and transformers read (one tensor per expert
    projection, as DeepSeek-V3's files have them), bf16 except the router."""
    out = per_expert(model.state_dict())
    expected = {k: v.shape for k, v in make_weights(config).items()}
    got = {k: v.shape for k, v in out.items()}
    if got != expected:
        raise RuntimeError(f"exported names or shapes differ from the checkpoint layout: "
                           f"missing {sorted(set(expected) - set(got))[:4]}, extra {sorted(set(got) - set(expected))[:4]}")
    return checkpoint_dtypes(out)


# ----------------------------------------------------------------------
# training
def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def loss_on(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-token cross-entropy of x [B, T] (targets are x shifted by one)."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, device: torch.device, batch: int = 16) -> float:
    """Mean cross-entropy (nats per token) over the held-out windows [N, WINDOW]."""
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        part = windows[i:i + batch].to(device)
        total += loss_on(model, part, device).item() * len(part)
    model.train()
    return total / len(windows)


def unigram_nats(train_ids: torch.Tensor, windows: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of the held-out windows under add-one-smoothed token frequencies of the training stream."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[windows[:, 1:].flatten()].mean().item()


def balancedness(load: torch.Tensor) -> list[float]:
    """mean / max load per layer (1.0 = perfectly even)."""
    return [round((row.mean() / row.max()).item(), 4) for row in load]


def train(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    # NOTE: the threads of CPU scatter-adds (index_add_ in the experts and in embedding backward) sum in any
    # order; the deterministic kernels make two runs of the same command give the same weights.
    torch.use_deterministic_algorithms(True, warn_only=True)
    root = Path(args.corpus_dir or sysconfig.get_paths()["stdlib"])
    train_docs, heldout_docs = read_corpus(root)
    print(f"corpus {root}: {len(train_docs)} training files ({sum(len(t) for _, t in train_docs):,} chars), "
          f"{len(heldout_docs)} held out", flush=True)

    t0 = time.time()
    tokenizer = train_tokenizer((line for _, text in train_docs for line in text.splitlines(keepends=True)),
                                args.vocab_size)
    config = default_config(vocab_size=(tokenizer.get_vocab_size() + 63) // 64 * 64) | {"torch_dtype": "bfloat16"}
    train_ids = token_stream(tokenizer, [t for _, t in train_docs])
    sample = heldout_sample(heldout_docs, args.heldout_chars)
    held_ids = tokenizer.encode(sample, add_special_tokens=False).ids
    windows = torch.tensor(heldout_windows(held_ids, tokenizer.token_to_id(BOS_TOKEN), min(WINDOW, args.seq_len)))
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.time() - t0:.1f}s; {len(train_ids):,} training "
          f"tokens, {len(windows)} held-out windows", flush=True)

    model = build_model(config, args.seed).to(device)
    layers = moe_layers(model, config)
    counter = LoadCounter(layers, config, device)
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    gen = torch.Generator().manual_seed(args.seed)
    record = {"loss": [], "eval": [], "balancedness": []}
    best = (float("inf"), None, -1)
    t_train = time.time()
    step = 0
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        x = torch.stack([train_ids[s:s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = loss_on(model, x, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        load = counter.take()
        update_bias(layers, load, args.bias_gamma)
        last = step + 1 == args.steps or (args.max_minutes and time.time() - t_train > args.max_minutes * 60)
        if step % args.log_every == 0 or last:
            record["loss"].append([step, round(loss.item(), 4)])
            record["balancedness"].append([step, balancedness(load)])
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"balancedness {balancedness(load)}  {time.time() - t_train:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or last:
            counter.active = False
            nats = evaluate(model, windows, device)
            counter.active = True
            record["eval"].append([step + 1, round(nats, 4)])
            print(f"step {step + 1:5d}  held-out loss {nats:.4f}  perplexity {math.exp(nats):.2f}", flush=True)
            if nats < best[0]:
                best = (nats, export_state(model, config), step + 1)
        if last:
            break
    train_seconds = time.time() - t_train
    nats, state, best_step = best
    unigram = unigram_nats(train_ids, windows, config["vocab_size"])
    print(f"kept step {best_step}: held-out perplexity {math.exp(nats):.2f} (unigram {math.exp(unigram):.2f}); "
          f"{step + 1} steps in {train_seconds:.0f}s", flush=True)
    return {"tokenizer": tokenizer, "config": config, "state": state, "sample": sample, "windows": windows,
            "record": record | {
        "steps_run": step + 1, "kept_step": best_step, "train_seconds": round(train_seconds, 1),
        "heldout_windows": len(windows), "heldout_perplexity": round(math.exp(nats), 3),
        "unigram_perplexity": round(math.exp(unigram), 3),
        "final_balancedness": record["balancedness"][-1][1],
        "corpus": {"root": str(root), "python": sys.version.split()[0], "train_files": len(train_docs),
                   "train_chars": sum(len(t) for _, t in train_docs), "train_tokens": len(train_ids),
                   "heldout_files": [rel for rel, _ in heldout_docs]},
    }}


def write_model(out: Path, result: dict, args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config, tokenizer = result["config"], result["tokenizer"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}) + "\n")
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    (out / "heldout.txt").write_text(result["sample"], encoding="utf-8")
    save_file(result["state"], str(out / "model.safetensors"), metadata={"format": "pt"})
    record = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": vars(args),
              "torch": torch.__version__, "device_name": device_name(args.device)} | result["record"]
    # The number the perplexity test's bound comes from: the written bf16 file, read back by transformers.
    record["shipped_heldout_perplexity"] = round(reloaded_perplexity(out, result["windows"], args.device), 3)
    print(f"written checkpoint, read back: held-out perplexity {record['shipped_heldout_perplexity']}", flush=True)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")


def reloaded_perplexity(out: Path, windows: torch.Tensor, device: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).to(device)
    return math.exp(evaluate(model, windows, torch.device(device)))


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory to write the model into")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--max-minutes", type=float, default=None, help="stop early after this long (recorded)")
    p.add_argument("--corpus-dir", default=None, help="default: the running interpreter's standard library")
    p.add_argument("--vocab-size", type=int, default=3072)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-gamma", type=float, default=1e-4, help="step of the routing-bias balancing")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--heldout-chars", type=int, default=HELDOUT_CHARS, help="size of the shipped held-out sample")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    args = p.parse_args(argv)
    result = train(args)
    write_model(Path(args.out), result, args)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
