"""The embedded default model: a tiny DeepSeek-V3 that ships inside the package, and its random-weight twin.

`default_model_path()` is the trained model in moeserve/models/default/ (config.json, generation_config.json,
model.safetensors in bf16, tokenizer.json, tokenizer_config.json, and training.json, the record of the run of
scripts/train_default_model.py that made it): `moeserve serve` with no model serves it, with no build step and
no download. Its architecture is `default_config` (MLA + noaux_tc-routed MoE) with a 3,072-token vocabulary.

`random_model_path()` builds the same architecture with random weights drawn from a fixed seed and a byte-level
BPE tokenizer trained on default_corpus.txt (public-domain English), cached under $MOESERVE_CACHE, for tests
that want a model whose numbers do not move when the shipped one is retrained. Two builds give byte-identical
files. It needs torch, safetensors and tokenizers, not transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moeserve.paths import cache_root

if TYPE_CHECKING:
    from moeserve.args import ServerArgs

SHIPPED_DIR = Path(__file__).parent / "default"
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json")
CACHE_NAME = "random-model-v1"  # bump when any file the random builder writes changes
SEED = 20250101
INIT_STD = 0.02

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]  # ids 0..4
TOKENIZER_VOCAB_SIZE = 1024

# DeepSeek-V3's template: system prompts first (the tools the request offers after them), then User/Assistant turns;
# an assistant's tool calls and the tool results that answer them in DeepSeek-V3's tool-call markers.
_TOOL_CALL = ("'<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc['function']['name'] + '\\n```json\\n' + "
              "(tc['function']['arguments'] if tc['function']['arguments'] is string "
              "else tc['function']['arguments'] | tojson) + '\\n```<｜tool▁call▁end｜>'")
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', in_outputs=false) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if ns.system_prompt %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' %}{% endif %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}"
    "{%- if ns.system_prompt %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' %}{% endif %}"
    "{% set ns.system_prompt = ns.system_prompt + '## Tools\\nYou have access to the following tools:\\n' %}"
    "{%- for tool in tools %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n### ' + tool['function']['name'] + '\\nDescription: ' + "
    "(tool['function']['description'] or '') + '\\nParameters: ' + (tool['function']['parameters'] | tojson) + "
    "'\\n' %}"
    "{%- endfor %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\nTo call tools, answer with <｜tool▁calls▁begin｜>, then for "
    "each call <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, a json code block of its arguments and "
    "<｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>.' %}"
    "{%- endif %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if not ns.in_outputs %}{{ '<｜tool▁outputs▁begin｜>' }}{% set ns.in_outputs = true %}{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- else %}"
    "{%- if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.in_outputs = false %}{% endif %}"
    "{%- if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    f"{{%- for tc in message['tool_calls'] %}}{{{{ {_TOOL_CALL} }}}}{{%- endfor %}}"
    "{{ '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{ '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] != 'system' %}"
    "{{ raise_exception('unsupported message role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def default_config(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> dict:
    """config.json of the default model (DeepSeek-V3 field names and meanings, tiny sizes)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,  # dense MLP of the first_k_dense_replace layers
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_interleave": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def resolve_model_path(server_args: ServerArgs) -> str:
    """server_args.model_path, set to the shipped default model when none was given."""
    if server_args.model_path is None:
        server_args.model_path = default_model_path()
    return server_args.model_path


def default_model_path() -> str:
    """Directory of the trained default model that ships inside the package."""
    missing = [name for name in SHIPPED_FILES if not (SHIPPED_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the default model's files {missing} are missing from {SHIPPED_DIR}: the package "
                                "was installed without its package data; reinstall moeserve or pass --model-path")
    return str(SHIPPED_DIR)


def random_model_path() -> str:
    """Directory of the random-weight default model, built on first use under $MOESERVE_CACHE (or
    ~/.cache/moeserve)."""
    root = cache_root()
    final = root / CACHE_NAME
    if (final / "config.json").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    # NOTE: built in a private directory and renamed into place, so a reader never sees half a model and two
    # processes building at once both end up with the same (identical) directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=root))
    try:
        build_default_model(str(tmp))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def build_default_model(out_dir: str) -> None:
    """Write every file of the random-weight default model into `out_dir` (which must exist)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config())

    config = default_config(vocab_size=_round_up(tokenizer.get_vocab_size(), 64))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False,
    })
    save_file(make_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------
# tokenizer
def build_tokenizer():
    """A byte-level BPE tokenizer (DeepSeek-V3's special tokens) trained on the embedded corpus."""
    corpus = (Path(__file__).parent / "default_corpus.txt").read_text(encoding="utf-8")
    return train_tokenizer(corpus.splitlines(keepends=True), TOKENIZER_VOCAB_SIZE)


def train_tokenizer(lines: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer with DeepSeek-V3's special tokens (ids 0..4) and a BOS post-processor, trained
    on `lines` (deterministic for the same lines)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0", pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)])
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": default_config()["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------
# weights
def make_weights(config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under transformers' DeepseekV3ForCausalLM names, drawn from SEED."""
    gen = torch.Generator().manual_seed(SEED)
    weights: dict[str, torch.Tensor] = {}

    def normal(name: str, *shape: int) -> None:
        weights[name] = (torch.randn(*shape, generator=gen) * INIT_STD).contiguous()

    def norm(name: str, size: int) -> None:
        # Not exactly ones, so that a loader mixing up two norms is caught by parity tests.
        weights[name] = (1.0 + torch.randn(size, generator=gen) * INIT_STD).contiguous()

    H, V = config["hidden_size"], config["vocab_size"]
    n_heads = config["num_attention_heads"]
    qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    E = config["n_routed_experts"]
    moe_inter = config["moe_intermediate_size"]

    def mlp(prefix: str, inter: int) -> None:
        normal(f"{prefix}.gate_proj.weight", inter, H)
        normal(f"{prefix}.up_proj.weight", inter, H)
        normal(f"{prefix}.down_proj.weight", H, inter)

    normal("model.embed_tokens.weight", V, H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", H)
        normal(f"{p}.self_attn.q_a_proj.weight", q_lora, H)
        norm(f"{p}.self_attn.q_a_layernorm.weight", q_lora)
        normal(f"{p}.self_attn.q_b_proj.weight", n_heads * qk_head, q_lora)
        normal(f"{p}.self_attn.kv_a_proj_with_mqa.weight", kv_lora + config["qk_rope_head_dim"], H)
        norm(f"{p}.self_attn.kv_a_layernorm.weight", kv_lora)
        normal(f"{p}.self_attn.kv_b_proj.weight",
               n_heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_lora)
        normal(f"{p}.self_attn.o_proj.weight", H, n_heads * config["v_head_dim"])
        norm(f"{p}.post_attention_layernorm.weight", H)
        if i < config["first_k_dense_replace"]:
            mlp(f"{p}.mlp", config["intermediate_size"])
            continue
        normal(f"{p}.mlp.gate.weight", E, H)
        normal(f"{p}.mlp.gate.e_score_correction_bias", E)
        for e in range(E):
            mlp(f"{p}.mlp.experts.{e}", moe_inter)
        mlp(f"{p}.mlp.shared_experts", moe_inter * config["n_shared_experts"])
    norm("model.norm.weight", H)
    normal("lm_head.weight", V, H)
    return weights


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")
