"""The `moeserve` command: serve | generate | bench {one-batch,serving,dispatch} | eplb ..."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from moeserve.args import ServerArgs


def _server_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerArgs.add_cli_args(p)
    return p


def _args_or_exit(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ServerArgs:
    try:
        return ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable


def cmd_serve(argv: list[str]) -> int:
    parser = _server_parser("moeserve serve", "Start the OpenAI- and SGLang-compatible HTTP server.")
    args = _args_or_exit(parser, parser.parse_args(argv))
    if args.node_rank > 0:  # every node runs the same command; only node 0 serves HTTP
        from moeserve.models.default_model import resolve_model_path
        from moeserve.server.launch import run_worker_node

        resolve_model_path(args)
        return run_worker_node(args)
    from moeserve.server.http.server import run_server

    run_server(args)
    return 0


def cmd_generate(argv: list[str]) -> int:
    parser = _server_parser("moeserve generate", "Generate text for one prompt and print it.")
    parser.add_argument("--prompt", required=True, help="Prompt text.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="Apply the model's chat template to the prompt.")
    parser.add_argument("--json", action="store_true", help="Print the whole output as JSON.")
    ns = parser.parse_args(argv)
    args = _args_or_exit(parser, ns)  # from_cli_args takes the ServerArgs fields only
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
             "tbo": "moeserve.bench.tbo", "eplb": "moeserve.bench.eplb"}
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
              "  bench     one-batch | serving | offline | dispatch | tbo benchmarks\n"
              "  eplb      expert-placement tools: synth, analyze, simulate, plan", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
