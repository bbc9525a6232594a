"""Prompts for the serving benchmark: random token ids, ShareGPT conversations, generated shared prefixes, and
multi-turn conversations (whose later prompts hold the server's own earlier answers, so they are built as the run
goes: `Conversation.turn_request`).

Each dataset is a list of BenchRequest (prompt text, its length in tokens, the output length to ask for).
Lengths follow SGLang's bench_serving: `--random-range-ratio r` draws each length uniformly from
[max(1, floor(L * r)), L], so r = 1 fixes it at L and r = 0.5 spans [L/2, L].
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

# ShareGPT filters of SGLang's and vLLM's benchmarks.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens: the dataset's count (no BOS); bench serving recounts with served_prompt_len
    output_len: int
    messages: list[dict] | None = None  # a chat backend's messages (else the prompt is one user message)
    turn: int = 0  # 1-based turn of a multi-turn conversation; 0 for single requests


def served_prompt_len(tokenizer: Any, prompt: str, chat: bool) -> int:
    """The prompt's length in tokens as the server counts it, and so as the result table does: with BOS for a text
    prompt (/generate, /v1/completions), the chat template's rendering of one user message for a chat request."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(tokenizer.encode(prompt))


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    low = max(1, int(length * ratio))
    return [rng.randint(low, max(low, length)) for _ in range(n)]


def _random_text(rng: random.Random, tokenizer: Any, num_tokens: int, allowed: list[int]) -> str:
    """Text decoded from random token ids; it re-tokenizes to about `num_tokens` tokens."""
    return tokenizer.decode([rng.choice(allowed) for _ in range(num_tokens)], skip_special_tokens=True)


def _allowed_ids(tokenizer: Any) -> list[int]:
    """Ids to draw random prompts from: not special, and whole characters (no stray UTF-8 bytes)."""
    special = set(getattr(tokenizer, "all_special_ids", []))
    return [i for i in range(tokenizer.vocab_size)
            if i not in special and "\ufffd" not in tokenizer.decode([i], skip_special_tokens=True)]


def random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """Prompts of random token ids (decoded to text) with random lengths."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    reqs = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        text = _random_text(rng, tokenizer, n_in, allowed)
        reqs.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), n_out))
    return reqs


def sharegpt_requests(tokenizer: Any, path: str, num_prompts: int, seed: int,
                      fixed_output_len: int | None = None) -> list[BenchRequest]:
    """The first human turn of ShareGPT conversations as prompts, the first reply's length as output length."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    pairs = []
    for entry in data:
        turns = (entry.get("conversations") or entry.get("conversation") or []) if isinstance(entry, dict) else []
        if len(turns) >= 2:
            pairs.append((_turn_text(turns[0]), _turn_text(turns[1])))
    rng = random.Random(seed)
    rng.shuffle(pairs)
    reqs: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(reqs) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        reqs.append(BenchRequest(prompt, prompt_len, output_len))
    if not reqs:
        raise ValueError(f"{path}: no conversation passed the length filters")
    return reqs


def _turn_text(turn: Any) -> str:
    if isinstance(turn, dict):
        return str(turn.get("value", turn.get("content", "")))
    return str(turn)


def shared_prefix_requests(tokenizer: Any, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                           question_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Groups of prompts sharing a long random system prefix (a prefix-cache workload), in shuffled order."""
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    reqs = []
    for _ in range(num_groups):
        system = _random_text(rng, tokenizer, system_prompt_len, allowed)
        for _ in range(prompts_per_group):
            prompt = system + "\n\n" + _random_text(rng, tokenizer, question_len, allowed)
            reqs.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), output_len))
    rng.shuffle(reqs)
    return reqs


# ----------------------------------------------------------------------
# multi-turn conversations
TURN_SEP = "\n\n"  # between the system prompt, user messages and answers in a text prompt


@dataclass
class Conversation:
    """One conversation: a system prompt (shared by all conversations) and its users' messages, one per turn.
    Turn k's prompt is the system prompt, then every earlier message and the server's answer to it, then message k,
    each followed by TURN_SEP; each turn asks for `output_len` tokens. The separator after message k is where the
    answer starts (what a chat template's assistant header is), so turn k + 1's prompt begins with turn k's prompt
    and its answer, as the server saw and wrote them: the answer's KV is the next turn's history."""

    system: str
    user_messages: list[str]
    output_len: int

    def turn_request(self, tokenizer: Any, answers: list[str]) -> BenchRequest:
        """The request of turn len(answers) + 1, given the answers to the turns before it."""
        k = len(answers)
        assert k < len(self.user_messages)
        parts = [self.system] if self.system else []
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for user, answer in zip(self.user_messages[:k], answers, strict=True):
            parts += [user, answer]
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        parts.append(self.user_messages[k])
        messages.append({"role": "user", "content": self.user_messages[k]})
        prompt = "".join(part + TURN_SEP for part in parts)
        return BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), self.output_len,
                            messages, k + 1)


def multiturn_conversations(tokenizer: Any, num_conversations: int, turns: int, system_prompt_len: int,
                            user_len: int, output_len: int, seed: int) -> list[Conversation]:
    """Conversations of `turns` turns each: one random system prompt of `system_prompt_len` tokens shared by all,
    and distinct random user messages of `user_len` tokens (so that prompts differ, and so do MoE routes)."""
    if num_conversations < 1 or turns < 1:
        raise ValueError(f"the multi-turn dataset needs at least one conversation and one turn, got "
                         f"{num_conversations} conversations of {turns} turns")
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    system = _random_text(rng, tokenizer, system_prompt_len, allowed) if system_prompt_len > 0 else ""
    return [Conversation(system, [_random_text(rng, tokenizer, user_len, allowed) for _ in range(turns)], output_len)
            for _ in range(num_conversations)]
