"""The `moeserve` command: serve | generate | bench {one-batch,serving,dispatch,kv-transfer,pd} | eplb ..."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from moeserve.args import SERVE_ONLY_FLAGS, ServerArgs


def _server_parser(prog: str, description: str, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    # Each flag's help says its default once (ServerArgs.add_cli_args writes it). The usage line is short: the
    # whole flag list (80 flags) would bury a one-line error; --help lists them by topic.
    p = argparse.ArgumentParser(prog=prog, description=description, usage=f"{prog} [options]  (--help: the flags)")
    ServerArgs.add_cli_args(p, skip=skip)
    return p


def _args_or_exit(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ServerArgs:
    try:
        return ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable


def _check_model_or_exit(parser: argparse.ArgumentParser, args: ServerArgs) -> None:
    """The model's config.json read and the parallel layout checked, before any process starts: a missing model
    directory, one without config.json, or a layout the model cannot run is a usage error (exit 2, one line), not
    a traceback nor tracebacks from every rank."""
    from moeserve.server.startup import load_model_config

    try:
        load_model_config(args)
    except (ValueError, OSError) as e:  # OSError: FileNotFoundError, a directory that cannot be read
        parser.error(str(e))


def cmd_serve(argv: list[str]) -> int:
    parser = _server_parser("moeserve serve", "Start the OpenAI- and SGLang-compatible HTTP server.")
    args = _args_or_exit(parser, parser.parse_args(argv))
    _check_model_or_exit(parser, args)
    if args.node_rank > 0:  # every node runs the same command; only node 0 serves HTTP (the model resolved above)
        from moeserve.server.launch import run_worker_node

        return run_worker_node(args)
    from moeserve.server.http.server import run_server

    return run_server(args)  # 1 when the engine died, so that a supervisor restarts the server


def cmd_generate(argv: list[str]) -> int:
    parser = _server_parser("moeserve generate", "Generate text for one prompt and print it (the offline Engine: no "
                            "HTTP server; the model and engine flags are those of `moeserve serve`).",
                            skip=SERVE_ONLY_FLAGS)
    own = parser.add_argument_group("generation")
    own.add_argument("--prompt", required=True, help="Prompt text.")
    own.add_argument("--max-new-tokens", type=int, default=64, help="Most tokens to generate (default: 64).")
    own.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy (default: 0).")
    own.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass, in (0, 1] (default: 1).")
    own.add_argument("--top-k", type=int, default=-1, help="Sample from the k likeliest tokens; -1: all (default: -1).")
    own.add_argument("--seed", type=int, default=None, help="Sampling seed (default: none, a fresh draw).")
    own.add_argument("--chat", action="store_true", help="Apply the model's chat template to the prompt.")
    own.add_argument("--json", action="store_true", help="Print the whole output as JSON.")
    ns = parser.parse_args(argv)
    args = _args_or_exit(parser, ns)  # from_cli_args takes the ServerArgs fields only
    _check_model_or_exit(parser, args)
    from moeserve.server.engine import Engine

    engine = Engine(**vars(args))
    try:
        prompt = ns.prompt
        if ns.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
                  "top_k": ns.top_k, "seed": ns.seed}
        out = engine.generate(prompt, params)
        print(json.dumps(out, indent=2) if ns.json else out["text"])
    finally:
        engine.shutdown()
    return 0


def cmd_bench(argv: list[str]) -> int:
    kinds = {"one-batch": "moeserve.bench.one_batch", "serving": "moeserve.bench.serving",
             "offline": "moeserve.bench.offline", "dispatch": "moeserve.bench.dispatch",
             "tbo": "moeserve.bench.tbo", "eplb": "moeserve.bench.eplb", "kv-transfer": "moeserve.bench.kv_transfer",
             "pd": "moeserve.bench.pd", "cpu-compare": "moeserve.bench.cpu_compare"}
    if not argv or argv[0] not in kinds:
        print(f"usage: moeserve bench {{{','.join(kinds)}}} ...", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(kinds[argv[0]]).main(argv[1:]) or 0


def cmd_eplb(argv: list[str]) -> int:
    from moeserve.eplb.tools.cli import main

    return main(argv) or 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench, "eplb": cmd_eplb}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in COMMANDS:
        print("usage: moeserve {serve,generate,bench,eplb} [options]\n"
              "  serve     start the HTTP server (default model: the embedded tiny DeepSeek-V3)\n"
              "  generate  one-shot generation for a prompt\n"
              "  bench     one-batch | serving | offline | dispatch | tbo | eplb | kv-transfer | pd benchmarks\n"
              "  eplb      expert-placement tools: synth, analyze, simulate, plan", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
