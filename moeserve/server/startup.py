"""Start-up of the server process (node 0), for the HTTP server and the offline Engine alike: the model and its
fit, the tokenizer, a prefill server's bootstrap server, the ranks; a TokenizerManager gets the parts."""

from __future__ import annotations

import os

from moeserve.args import ServerArgs
from moeserve.constrained.registry import make_grammar_backend
from moeserve.core.model_config import ModelConfig
from moeserve.models.default_model import SHIPPED_DIR, resolve_model_path
from moeserve.server.dp_controller import DPController
from moeserve.server.rank_client import RankClient
from moeserve.server.tokenizer_manager import DEFAULT_MODEL_NAME, TokenizerManager
from moeserve.server.validation import RequestValidator


def start_engine(server_args: ServerArgs) -> TokenizerManager:
    """Start this server's ranks and everything around them; a TokenizerManager ready to serve."""
    if server_args.node_rank != 0:
        raise ValueError("the tokenizer manager runs on node 0; other nodes run only their ranks "
                         "(moeserve serve with --node-rank > 0 does that)")
    model_path, config = load_model_config(server_args)
    name = server_args.served_model_name or default_served_name(model_path)
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        from moeserve.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(server_args.tokenizer_path or model_path)
    num_dp, bootstrap = server_args.num_dp_groups, None
    if server_args.disagg.is_prefill:  # before the ranks start: they register there
        from moeserve.disagg.bootstrap import BootstrapServer

        bootstrap = BootstrapServer(server_args.host, server_args.disagg.bootstrap_port, server_args.api_key, num_dp)
    try:
        ranks = RankClient(server_args)
    except BaseException:
        if bootstrap is not None:
            bootstrap.close()
        raise
    ready = ranks.ready
    grammar = make_grammar_backend(server_args.grammar_backend, tokenizer, ready.vocab_size)
    validator = RequestValidator(tokenizer, ready.vocab_size, ready.context_length, ready.num_kv_tokens, grammar)
    return TokenizerManager(server_args, config, name, tokenizer, DPController(num_dp), ranks, validator, bootstrap)


def load_model_config(args: ServerArgs) -> tuple[str, ModelConfig]:
    """The model's directory and config; ValueError when the parallel layout does not fit the model."""
    model_path = resolve_model_path(args)
    config = ModelConfig.from_pretrained(model_path)
    check_model_fits(args, config)
    if args.speculative_algorithm:  # the draft's MTP layer: refused here, not on every rank
        from moeserve.models.loader import mtp_checkpoint

        mtp_checkpoint(args, config)
    return model_path, config


def default_served_name(model_path: str) -> str:
    """The name the API reports when --served-model-name is not given: the model directory's name, 'default' for
    the embedded model (not its cache path)."""
    if os.path.realpath(model_path) == os.path.realpath(SHIPPED_DIR):
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model_path)) or model_path


def check_model_fits(args: ServerArgs, config: ModelConfig) -> None:
    """Refuse, before any process starts, a parallel layout the model cannot run (the ranks would each die on an
    assertion): ValueError saying what does not split and which flags to change."""
    tp = args.attn_tp_size
    group = (f"--tp-size {args.tp_size} / --dp-size {args.dp_size} with --enable-dp-attention"
             if args.enable_dp_attention else f"--tp-size {args.tp_size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ValueError(
            f"{config.architecture} has {heads} attention heads, which do not split over the {tp} ranks of an "
            f"attention group ({group}): use an attention group size that divides {heads} (--enable-dp-attention "
            f"--dp-size makes the groups smaller)")
    if config.kv_lora_rank is None and kv_heads % tp and tp % kv_heads:  # GQA: each rank holds whole KV heads
        raise ValueError(
            f"{config.architecture} has {kv_heads} KV heads, which neither split over nor spread evenly across the "
            f"{tp} ranks of an attention group ({group}): use a group size that divides {kv_heads} or is a multiple "
            "of it")
    physical = config.num_experts + args.ep_num_redundant_experts
    if config.num_experts and args.ep_size > 1 and physical % args.ep_size:
        raise ValueError(
            f"{config.architecture} has {physical} physical experts ({config.num_experts} + "
            f"--ep-num-redundant-experts {args.ep_num_redundant_experts}), which do not split over --ep-size "
            f"{args.ep_size}: make the expert count a multiple of the EP size with --ep-num-redundant-experts")

