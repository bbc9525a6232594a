"""The far side of a KV transfer test, as its own process: `python -m tests.disagg.kv_peer BACKEND SEED NUM_PAGES`.

It builds KV-pool-shaped buffers of random data (make_buffers), starts the backend over them and prints its
endpoint as one JSON line, then obeys stdin lines: `dump PATH` saves its buffers with torch.save and prints
`dumped`; `exit` (or end of input) closes the backend and exits.
"""

from __future__ import annotations

import json
import sys

import torch

from moeserve.disagg.transfer.registry import backend_class

PAGE_SIZE = 4


def make_buffers(seed: int, num_pages: int) -> list[torch.Tensor]:
    """Buffers shaped like a KV pool's ([num_slots, ...] rows, page_size rows a page), each with other page bytes:
    an MLA latent (bf16 [slots, 1, 72]), GQA K and V (fp16 [slots, 2, 16]), and an fp32 buffer ([slots, 3])."""
    g = torch.Generator().manual_seed(seed)
    slots = num_pages * PAGE_SIZE
    shapes = [((slots, 1, 72), torch.bfloat16), ((slots, 2, 16), torch.float16), ((slots, 2, 16), torch.float16),
              ((slots, 3), torch.float32)]
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in shapes]


def main() -> None:
    name, seed, num_pages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    buffers = make_buffers(seed, num_pages)
    backend = backend_class(name)(buffers, PAGE_SIZE, host="127.0.0.1")
    print(json.dumps(backend.endpoint()), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "dump":
            torch.save(buffers, args[0])
            print("dumped", flush=True)
        elif cmd == "exit":
            break
    backend.close()


if __name__ == "__main__":
    main()
