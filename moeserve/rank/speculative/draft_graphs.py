"""The draft model's decode-row steps replayed from CUDA graphs: a round's draft extend over the last round's
accepted tokens (1 to k + 1 rows per request, verify_rows.py) and its one-token drafts 2..k (round.py).

Such a step reads tokens and hidden states [rows, H]: the tokens go in as the batch's input ids, the hidden states
through one more static buffer that every graph reads. Captured at the verify graphs' row buckets (B requests times
k + 1, what an extend over accepted tokens fits in) and request buckets (B rows, a one-token step), at their length
buckets; padding rows read stale hidden states and write their KV to the draft pool's scratch slot 0, and their
outputs are dropped, as the decode graphs' padding rows are.
"""

from __future__ import annotations

import torch

from moeserve.core.forward_batch import ForwardBatch
from moeserve.rank.cuda_graph_runner import CudaGraphRunner
from moeserve.rank.speculative.drafter import Drafter


class DraftStepGraphs:
    def __init__(self, drafter: Drafter, hidden_size: int, dtype: torch.dtype, verify: CudaGraphRunner,
                 rows_per_request: int):
        self.drafter = drafter
        requests = [n // rows_per_request for n in verify.bs_buckets]  # the verify graphs' request buckets
        sizes = sorted(set(requests) | set(verify.bs_buckets))
        device = verify.device
        self.hidden_in = torch.zeros(sizes[-1], hidden_size, dtype=dtype, device=device)
        self.graphs = CudaGraphRunner(self._forward, drafter.kv_pool, sizes[-1], verify.max_len, device, sizes,
                                      with_hidden=True)

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.forward(fb, fb.input_ids, self.hidden_in[:fb.input_ids.shape[0]])

    def capture_all(self, progress: bool = True) -> None:
        self.graphs.capture_all(progress)

    def forward(self, fb: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Drafter.forward for a batch of decode rows (fb on the device, with decode_slots): (logits [rows, V],
        hidden [rows, H]), from a graph where one fits."""
        if not self.graphs.can_run(fb):
            return self.drafter.forward(fb, input_ids, hidden)
        self.hidden_in[:hidden.shape[0]].copy_(hidden)
        fb.input_ids = input_ids
        return self.graphs.run_hidden(fb)
