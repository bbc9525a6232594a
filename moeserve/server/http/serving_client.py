"""ServingClient: what the HTTP layer asks of the engine behind it.

The TokenizerManager is the one the server runs; the tests' FakeClient (tests/server/server_fakes.py) has
the same shape and serves the HTTP tests without rank processes. The HTTP layer only reads the members (the
TokenizerManager's health and load are read-only properties).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from moeserve.args import ServerArgs
from moeserve.rank.io_struct import ExpertDistributionOut, LoadOut
from moeserve.server.tokenizer_manager import GenerateInput
from moeserve.server.validation import RequestValidator
from moeserve.text.tokenizer import Tokenizer


class ModelFacts(Protocol):
    """What /get_model_info tells of the checkpoint (ModelConfig has more)."""

    @property
    def architecture(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int: ...


class ServingClient(Protocol):
    """The engine as the HTTP endpoints see it: generation, abort, control requests, and facts to report."""

    server_args: ServerArgs
    model_name: str
    tokenizer: Tokenizer | None
    context_length: int  # most tokens of one request (prompt + output), as the ranks report it
    max_total_tokens: int  # KV cache tokens of one DP group: most tokens one request can hold
    weight_format: str  # what the weights are, as the ranks loaded them ('bfloat16', 'fp8 e4m3 128x128 blocks ...')
    validator: RequestValidator  # prompt limits and tokenizing off the event loop (the chat endpoint's too)

    @property
    def model_config(self) -> ModelFacts: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def last_load(self) -> list[LoadOut]:
        """The latest load of each DP group, for /get_server_info and /metrics."""

    def generate(self, obj: GenerateInput) -> AsyncGenerator[dict, None]:
        """Output dicts of one request (one per chunk when streaming, else one at the end); raises
        InvalidRequestError for a request it cannot serve, EngineDeadError once the engine is dead."""

    async def abort(self, rid: str) -> None: ...

    async def flush_cache(self) -> bool: ...

    async def get_load(self) -> list[LoadOut]: ...

    async def expert_distribution(self, action: str) -> list[ExpertDistributionOut]:
        """start / stop the recording on every group; ValueError if it cannot."""

    async def dump_expert_distribution(self, path: str | None = None) -> dict: ...
