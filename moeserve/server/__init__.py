"""The server process: everything on node 0 between an HTTP client (or the offline Engine) and the ranks.

tokenizer_manager.py (TokenizerManager: validate, tokenize, per-request state, detokenize and stream outputs,
aborts), dp_controller.py (which attention DP group gets a request), rank_client.py (ZeroMQ to the ranks,
receiver thread, watchdog, control requests), startup.py (everything in order before serving: model, fit check,
tokenizer, ranks), launch.py (starting and stopping the rank processes, their addresses), detokenizer.py (incremental detokenization), engine.py (the offline Engine), http/ (the HTTP
layer). The rank processes are moeserve/rank/.
"""
