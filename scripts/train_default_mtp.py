"""Train the multi-token-prediction (MTP) module of the embedded default model on its frozen main model.

    python scripts/train_default_mtp.py --device cpu --threads 2 --max-minutes 50 --out /tmp/mtp
    python scripts/train_default_mtp.py --device cuda --steps 4000 --batch-size 64 --seq-len 256 --out /tmp/mtp

The module is DeepSeek-V3's MTP module (the paper's k = 1), in the published checkpoint layout under
model.layers.{L}, L = num_hidden_layers:

    h'_i     = Block(eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i))))     # at position i
    logits_i = shared_head.head(shared_head.norm(h'_i))                      # the distribution of t_{i+2}

h_i is the main model's final-normed hidden state at position i (the one its LM head reads, the one SGLang's
NextN draft is fed), Block is transformers' DeepseekV3DecoderLayer with the main model's config (MLA + MoE), and
embed / head are the main model's, frozen. A chained draft step j > 1 feeds step j-1's shared_head.norm output as
its h and step j-1's token as its t, one position further on.

Objective: the drafts are verified against the main model, so the module is distilled from it. The loss is the KL
divergence from the main model's next-token distribution at position i+1 (the true prefix up to t_{i+1}) to the
module's distribution at position i, plus --ce-weight times the cross-entropy against the text's t_{i+2}. The block
starts from the main model's last layer and shared_head.norm from its final norm; the routing bias of the MoE is
balanced as the main model's was (scripts/train_default_model.py). Data: the main model's corpus recipe (the
running interpreter's standard library, the same held-out rule), tokenized with the shipped tokenizer.

Measured on the shipped held-out text (moeserve/models/default/heldout.txt): the top-1 agreement of the module's
draft with the main model's greedy next token, and, on greedy continuations of held-out prompts, the accept length
of speculative decoding with k = 1, 2, 3 chained draft tokens (tokens per verify step, the bonus token included).

It writes into --out a copy of --model-dir whose model.safetensors gains model.layers.{L}.* (bf16; the router fp32;
embed_tokens and shared_head.head are copies of the main model's, as DeepSeek-V3's checkpoint has them), whose
config.json says num_nextn_predict_layers 1, and training_mtp.json (command, data, curves, agreement, time).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_default_model import (  # noqa: E402
    LoadCounter,
    balancedness,
    checkpoint_dtypes,
    device_name,
    lr_at,
    make_optimizer,
    per_expert,
    read_corpus,
    token_stream,
    update_bias,
)

from moeserve.models.default_heldout import shipped_windows  # noqa: E402
from moeserve.models.default_model import SHIPPED_DIR  # noqa: E402


# ----------------------------------------------------------------------
# model
def load_main(model_dir: Path, device: torch.device) -> torch.nn.Module:
    """The main model (transformers' DeepseekV3ForCausalLM, fp32), frozen. MTP tensors in the file are ignored."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the MTP tensors of an already trained file are "unexpected" to it
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    return model


def mtp_layer_class():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    class MTPLayer(DeepseekV3DecoderLayer):
        """DeepSeek-V3's MTP module: its state dict has the published names under model.layers.{L}."""

        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            hidden, eps = config.hidden_size, config.rms_norm_eps
            self.enorm = DeepseekV3RMSNorm(hidden, eps=eps)
            self.hnorm = DeepseekV3RMSNorm(hidden, eps=eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            self.shared_head = nn.Module()
            self.shared_head.norm = DeepseekV3RMSNorm(hidden, eps=eps)

        def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, mask: torch.Tensor):
            """embeds, hidden [B, T, H] -> [B, T, H], the shared_head.norm output (the head's input and the next
            chained step's hidden)."""
            x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
            x = self(x, attention_mask=mask, position_embeddings=position_embeddings)
            return self.shared_head.norm(x)

    return MTPLayer


def build_mtp(main: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A fresh module: the block copied from the main model's last layer, shared_head.norm from its final norm,
    eh_proj passing hnorm(h) through (identity) plus a small random reading of the token."""
    config = main.config
    torch.manual_seed(seed)
    mtp = mtp_layer_class()(config, config.num_hidden_layers)
    missing, unexpected = mtp.load_state_dict(main.model.layers[-1].state_dict(), strict=False)
    assert not unexpected and sorted(missing) == ["eh_proj.weight", "enorm.weight", "hnorm.weight",
                                                  "shared_head.norm.weight"], (missing, unexpected)
    hidden = config.hidden_size
    with torch.no_grad():
        mtp.enorm.weight.fill_(1.0)
        mtp.hnorm.weight.fill_(1.0)
        mtp.shared_head.norm.weight.copy_(main.model.norm.weight)
        mtp.eh_proj.weight.normal_(0.0, config.initializer_range)
        mtp.eh_proj.weight[:, hidden:] += torch.eye(hidden)
    return mtp.to(main.device).float()


def additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    """[Q, K] bool (True = may attend) -> [1, 1, Q, K] float mask, 0 or -inf (what eager and sdpa both take)."""
    mask = torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, float("-inf"))
    return mask[None, None]


def rope(main: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) of the main model's rotary embedding at positions [T]."""
    return main.model.rotary_emb(x, positions[None])


@torch.no_grad()
def teacher(main: torch.nn.Module, ids: torch.Tensor, device: torch.device):
    """ids [B, N] -> (hidden [B, N, H] final-normed, logits [B, N, V] fp32) of the main model."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = main.model(input_ids=ids).last_hidden_state
        logits = main.lm_head(hidden)
    return hidden.float(), logits.float()


def draft_logits(main, mtp, ids: torch.Tensor, hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Teacher-forced first draft step: ids [B, T+1] (t_0..t_T), hidden [B, T+1, H] -> logits [B, T, V] fp32,
    row i the module's distribution of t_{i+2} from (t_{i+1}, h_i) at position i."""
    T = ids.shape[1] - 1
    embeds = main.model.embed_tokens(ids[:, 1:])
    positions = torch.arange(T, device=device)
    mask = additive_mask(torch.ones(T, T, dtype=torch.bool, device=device).tril())
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = mtp.draft(embeds, hidden[:, :T], rope(main, embeds, positions), mask)
        logits = main.lm_head(out)
    return logits.float()


def distill_loss(student: torch.Tensor, target_logits: torch.Tensor, text: torch.Tensor, ce_weight: float):
    """(loss, kl, ce): KL(main || module) per token plus ce_weight x cross-entropy against the text."""
    logp = F.log_softmax(student, dim=-1)
    logq = F.log_softmax(target_logits, dim=-1)
    kl = (logq.exp() * (logq - logp)).sum(-1).mean()
    ce = F.nll_loss(logp.reshape(-1, logp.shape[-1]), text.reshape(-1))
    return kl + ce_weight * ce, kl, ce


# ----------------------------------------------------------------------
# evaluation
@torch.no_grad()
def heldout_agreement(main, mtp, windows: torch.Tensor, device: torch.device, batch: int = 16) -> dict:
    """On held-out windows [N, W] (teacher-forced text): how often the module's argmax is the main model's
    greedy next token, and the mean KL between them."""
    mtp.eval()
    agree = kl_sum = count = 0.0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch].to(device)
        hidden, logits = teacher(main, ids, device)
        student = draft_logits(main, mtp, ids, hidden, device)  # row i: t_{i+2} from (t_{i+1}, h_i)
        target = logits[:, 1:]  # the main model's next token after t_{i+1}
        agree += (student.argmax(-1) == target.argmax(-1)).sum().item()
        _, kl, _ = distill_loss(student, target, target.argmax(-1), 0.0)
        kl_sum += kl.item() * target.shape[0] * target.shape[1]
        count += target.shape[0] * target.shape[1]
    mtp.train()
    return {"agreement": agree / count, "kl": kl_sum / count, "tokens": int(count)}


@torch.no_grad()
def greedy_continuations(main, prompts: torch.Tensor, new_tokens: int, device: torch.device) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new_tokens]: the main model's greedy text (full forwards, no cache, so every
    token is the argmax of the same forward that the drafts are scored against)."""
    seq = prompts.to(device)
    for _ in range(new_tokens):
        _, logits = teacher(main, seq, device)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def chain_mask(n: int, depth: int, device: torch.device) -> torch.Tensor:
    """Attention of `depth` chained draft steps computed for all n start positions at once, as one sequence of
    depth * n queries (step-major). Step j's query at start i (position i + j - 1) sees step 1 at starts 0..i
    (the module's KV cache of the accepted text) and steps 2..j at start i (its own earlier drafts)."""
    step = torch.arange(depth * n, device=device) // n
    start = torch.arange(depth * n, device=device) % n
    same_start = start[:, None] == start[None, :]
    cached = (step[None, :] == 0) & (start[None, :] <= start[:, None])
    chained = same_start & (step[None, :] <= step[:, None])
    return cached | chained


@torch.no_grad()
def chained_drafts(main, mtp, seq: torch.Tensor, depth: int, device: torch.device) -> torch.Tensor:
    """seq [B, L] -> drafts [B, depth, L-1]: drafts[:, j, i] is draft j+1 of a round whose target hidden is h_i
    (it guesses seq[i + j + 2]). Step j+1's token input is the text's seq[i + j + 1]: where an earlier draft was
    wrong the later ones are never accepted, so their inputs do not matter."""
    hidden, _ = teacher(main, seq, device)
    B, L = seq.shape
    n = L - 1
    mask = additive_mask(chain_mask(n, depth, device))
    mtp.eval()
    out = []
    # Step by step: step j's queries need step j-1's output as their hidden; the cache part (step 1 of every
    # start) is recomputed each time, which keeps this one plain forward over the growing sequence.
    h_in = hidden[:, :n]
    tokens, positions, prev = [], [], None
    for j in range(depth):
        ids = torch.cat([seq[:, 1 + j:], torch.zeros(B, j, dtype=seq.dtype, device=device)], dim=1)[:, :n]
        tokens.append(ids)
        positions.append(torch.arange(n, device=device) + j)
        if prev is not None:
            h_in = torch.cat([h_in, prev], dim=1)
        embeds = main.model.embed_tokens(torch.cat(tokens, dim=1))
        pos = torch.cat(positions)
        m = mask[..., :(j + 1) * n, :(j + 1) * n]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            h_out = mtp.draft(embeds, h_in, rope(main, embeds, pos), m).float()
        prev = h_out[:, j * n:]
        out.append(main.lm_head(prev).argmax(-1))
    mtp.train()
    return torch.stack(out, dim=1)


def accept_lengths(seq: torch.Tensor, drafts: torch.Tensor, prompt_len: int, max_k: int) -> dict:
    """Greedy speculative decoding replayed over the main model's own continuation seq [B, L]: a round at h_p
    drafts k tokens, accepts the longest prefix equal to the text, and emits that many plus the target's next
    token; the next round starts that many tokens later. Returns, per k, the mean tokens per verify step."""
    B, L = seq.shape
    depth = drafts.shape[1]
    # ok[b, j, i]: draft j+1 from h_i equals seq[i + j + 2]
    ok = torch.zeros(B, depth, L - 1, dtype=torch.bool)
    for j in range(depth):
        ok[:, j, :L - 2 - j] = drafts[:, j, :L - 2 - j].cpu() == seq[:, j + 2:].cpu()
    result = {}
    for k in range(1, max_k + 1):
        emitted = rounds = 0
        for b in range(B):
            p = prompt_len - 1  # prefill gave h_p and the first generated token
            while p + k + 1 <= L - 1:
                accepted = 0
                while accepted < k and ok[b, accepted, p]:
                    accepted += 1
                emitted += accepted + 1
                rounds += 1
                p += accepted + 1
        result[k] = round(emitted / rounds, 4)
    per_depth = [round(ok[:, :j + 1, prompt_len - 1:L - 2 - j].all(1).float().mean().item(), 4) for j in range(depth)]
    return {"accept_length": result, "all_first_j_accepted": per_depth}


def chain_report(main, mtp, windows: torch.Tensor, prompts: int, prompt_len: int, new_tokens: int,
                 device: torch.device, depth: int = 3) -> dict:
    pick = torch.linspace(0, len(windows) - 1, prompts).round().long()
    seq = greedy_continuations(main, windows[pick, :prompt_len], new_tokens, device)
    drafts = chained_drafts(main, mtp, seq, depth, device)
    return accept_lengths(seq.cpu(), drafts.cpu(), prompt_len, depth) | {
        "prompts": prompts, "prompt_tokens": prompt_len, "greedy_tokens": new_tokens}


# ----------------------------------------------------------------------
# checkpoint
def mtp_tensors(mtp: torch.nn.Module, main: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module under the published names model.layers.{L}.*, with DeepSeek-V3's copies of the shared
    embedding and head (embed_tokens, shared_head.head)."""
    prefix = f"model.layers.{main.config.num_hidden_layers}."
    state = dict(mtp.state_dict())
    state["embed_tokens.weight"] = main.model.embed_tokens.weight
    state["shared_head.head.weight"] = main.lm_head.weight
    return checkpoint_dtypes({prefix + k: v for k, v in per_expert(state).items()})


def load_mtp(model_dir: Path, main: torch.nn.Module) -> torch.nn.Module:
    """The module written by this script, read back from model_dir/model.safetensors."""
    from safetensors.torch import load_file

    layer = main.config.num_hidden_layers
    prefix = f"model.layers.{layer}."
    tensors = {k[len(prefix):]: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()
               if k.startswith(prefix)}
    mtp = mtp_layer_class()(main.config, layer)
    experts = range(main.config.n_routed_experts)
    tensors["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [tensors.pop(f"mlp.experts.{e}.gate_proj.weight"), tensors.pop(f"mlp.experts.{e}.up_proj.weight")])
        for e in experts])
    tensors["mlp.experts.down_proj"] = torch.stack([tensors.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    for shared in ("embed_tokens.weight", "shared_head.head.weight"):
        tensors.pop(shared)
    mtp.load_state_dict(tensors, strict=True)
    return mtp.to(main.device).float()


# ----------------------------------------------------------------------
# training
def train(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model_dir = Path(args.model_dir)
    main = load_main(model_dir, device)
    config = json.loads((model_dir / "config.json").read_text())

    from tokenizers import Tokenizer

    t0 = time.time()
    root = Path(args.corpus_dir or sysconfig.get_paths()["stdlib"])
    train_docs, heldout_docs = read_corpus(root)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_ids = token_stream(tokenizer, [t for _, t in train_docs])
    windows = torch.tensor(shipped_windows(model_dir))
    if args.eval_windows:
        windows = windows[:args.eval_windows]
    print(f"corpus {root}: {len(train_docs)} training files, {len(train_ids):,} tokens ({time.time() - t0:.0f}s); "
          f"{len(windows)} held-out windows of {windows.shape[1]} tokens", flush=True)

    mtp = build_mtp(main, args.seed)
    counter = LoadCounter([mtp.mlp], config, device)
    opt = make_optimizer(mtp, args.lr, args.weight_decay, device)
    gen = torch.Generator().manual_seed(args.seed)
    counter.active = False
    start = heldout_agreement(main, mtp, windows, device)
    counter.active = True
    print(f"step     0  held-out agreement {start['agreement']:.4f}  kl {start['kl']:.4f} (before training)",
          flush=True)
    record = {"loss": [], "eval": [[0, round(start["agreement"], 4), round(start["kl"], 4)]], "balancedness": []}
    best = (start["agreement"], {k: v.clone() for k, v in mtp.state_dict().items()}, 0)
    t_train = time.time()
    step = 0
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - args.seq_len - 2, (args.batch_size,), generator=gen)
        ids = torch.stack([train_ids[s:s + args.seq_len + 2] for s in starts.tolist()]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        counter.active = False
        hidden, logits = teacher(main, ids[:, :-1], device)  # h_0..h_T and the main model's next-token logits
        counter.active = True
        student = draft_logits(main, mtp, ids[:, :-1], hidden, device)
        loss, kl, ce = distill_loss(student, logits[:, 1:], ids[:, 2:], args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        load = counter.take()
        update_bias([mtp.mlp], load, args.bias_gamma)
        last = step + 1 == args.steps or (args.max_minutes and time.time() - t_train > args.max_minutes * 60)
        if step % args.log_every == 0 or last:
            record["loss"].append([step, round(kl.item(), 4), round(ce.item(), 4)])
            record["balancedness"].append([step, balancedness(load)])
            print(f"step {step:5d}  kl {kl.item():.4f}  ce {ce.item():.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"balancedness {balancedness(load)}  {time.time() - t_train:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or last:
            counter.active = False
            ev = heldout_agreement(main, mtp, windows, device)
            counter.active = True
            record["eval"].append([step + 1, round(ev["agreement"], 4), round(ev["kl"], 4)])
            print(f"step {step + 1:5d}  held-out agreement {ev['agreement']:.4f}  kl {ev['kl']:.4f}", flush=True)
            if ev["agreement"] > best[0]:
                best = (ev["agreement"], {k: v.clone() for k, v in mtp.state_dict().items()}, step + 1)
        if last:
            break
    train_seconds = time.time() - t_train
    agreement, state, best_step = best
    mtp.load_state_dict(state)
    print(f"kept step {best_step}: held-out agreement {agreement:.4f}; {step + 1} steps in {train_seconds:.0f}s",
          flush=True)
    return {"main": main, "mtp": mtp, "windows": windows, "record": record | {
        "steps_run": step + 1, "kept_step": best_step, "train_seconds": round(train_seconds, 1),
        "train_minutes": round(train_seconds / 60, 2), "heldout_windows": len(windows),
        "heldout_agreement_before": round(start["agreement"], 4), "heldout_agreement": round(agreement, 4),
        "final_balancedness": record["balancedness"][-1][1],
        "corpus": {"root": str(root), "python": sys.version.split()[0], "train_files": len(train_docs),
                   "train_chars": sum(len(t) for _, t in train_docs), "train_tokens": len(train_ids),
                   "heldout_files": [rel for rel, _ in heldout_docs]},
    }}


def write_model(out: Path, result: dict, args: argparse.Namespace) -> None:
    from safetensors.torch import load_file, save_file

    model_dir, main, windows = Path(args.model_dir), result["main"], result["windows"]
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != model_dir.resolve():
        for path in model_dir.iterdir():
            if path.is_file():
                shutil.copyfile(path, out / path.name)
    layer = main.config.num_hidden_layers
    weights = {k: v for k, v in load_file(str(model_dir / "model.safetensors")).items()
               if not k.startswith(f"model.layers.{layer}.")}
    weights |= mtp_tensors(result["mtp"], main)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    device = torch.device(args.device)
    shipped = load_mtp(out, main)  # what the file holds (bf16), not the fp32 module trained
    ev = heldout_agreement(main, shipped, windows, device)
    chain = chain_report(main, shipped, windows, args.chain_prompts, args.chain_prompt_len, args.chain_tokens, device)
    print(f"written checkpoint, read back: held-out agreement {ev['agreement']:.4f} over {ev['tokens']} tokens, "
          f"accept length {chain['accept_length']} (k: tokens per verify step)", flush=True)
    import transformers

    record = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": vars(args),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "device_name": device_name(args.device)} | result["record"] | {
        "shipped_heldout_agreement": round(ev["agreement"], 4), "shipped_heldout_kl": round(ev["kl"], 4),
        "shipped_heldout_tokens": ev["tokens"], "greedy_chain": chain,
        "mtp_tensors": sorted(k for k in weights if k.startswith(f"model.layers.{layer}."))}
    (out / "training_mtp.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory to write the model (with its MTP module) into")
    p.add_argument("--model-dir", default=str(SHIPPED_DIR), help="the main model (default: the shipped one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--max-minutes", type=float, default=None, help="stop early after this long (recorded)")
    p.add_argument("--corpus-dir", default=None, help="default: the running interpreter's standard library")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--ce-weight", type=float, default=0.0, help="weight of the text's cross-entropy beside the KL")
    p.add_argument("--bias-gamma", type=float, default=1e-4, help="step of the routing-bias balancing")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--eval-windows", type=int, default=0, help="score only the first N held-out windows (0: all)")
    p.add_argument("--chain-prompts", type=int, default=16, help="held-out prompts for the accept-length replay")
    p.add_argument("--chain-prompt-len", type=int, default=64)
    p.add_argument("--chain-tokens", type=int, default=96, help="greedy tokens generated after each prompt")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    args = p.parse_args(argv)
    result = train(args)
    write_model(Path(args.out), result, args)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
