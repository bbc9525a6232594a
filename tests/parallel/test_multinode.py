"""Two "nodes" on one machine: node 1 runs `moeserve serve --node-rank 1` (ranks only), node 0 the engine.

Every node runs the same command line apart from --node-rank; the ranks meet over tcp:// on node 0's
--dist-init-addr. Greedy tokens equal the single-rank run.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from moeserve.server.engine import Engine
from tests.checkpoints import build_checkpoint
from tests.procs import free_port_block
from tests.rank.test_generation import NEW_TOKENS, _prompts, hf_greedy

pytestmark = pytest.mark.slow


def test_two_nodes_dp_attention_all2all(tmp_path):
    path = build_checkpoint("v3_groups", tmp_path / "m")
    port = free_port_block(4)
    common = ["--model-path", path, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}",
              "--enable-dp-attention", "--dp-size", "2", "--moe-a2a-backend", "all2all", "--skip-tokenizer-init"]
    node1 = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "serve", *common, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        eng = Engine(model_path=path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}",
                     enable_dp_attention=True, dp_size=2, moe_a2a_backend="all2all", skip_tokenizer_init=True)
        try:
            prompts = _prompts(21, [5, 17, 33, 9])
            outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW_TOKENS,
                                                                    "temperature": 0, "ignore_eos": True})
            assert [o["output_ids"] for o in outs] == hf_greedy("v3_groups", prompts)
            loads = eng.get_load()
            assert len(loads) == 2 and all(ld.num_cached_tokens > 0 for ld in loads)  # node 1's group served too
        finally:
            eng.shutdown()
        deadline = time.monotonic() + 30
        while node1.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node1.poll() == 0, "node 1 did not exit after node 0 shut down"
    finally:
        if node1.poll() is None:
            node1.kill()
        out = node1.communicate()[0]
    assert "Traceback" not in out, out[-3000:]
