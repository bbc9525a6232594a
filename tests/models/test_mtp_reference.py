"""DeepSeek's MTP layer (moeserve/models/mtp.py) against a reference written here from the DeepSeek-V3 paper
(section 2.2, multi-token prediction) and transformers' own DeepseekV3DecoderLayer, not from moeserve's code:

    logits(t_{i+2}) = head(norm_s(Block(eh_proj([norm_e(embed(t_{i+1})) ; norm_h(h_i)]))))

embed and head are the main model's (transformers' DeepseekV3ForCausalLM loaded from the checkpoint); Block is
layer L of transformers' model one layer deeper loaded from the same checkpoint (so transformers' loader reads the
MTP layer's decoder tensors, model.layers.L.*); the three norms and eh_proj are read from the safetensors file and
applied by the paper's formulas here. The paper writes [h ; e]; DeepSeek's published eh_proj takes the embedding
first, as SGLang and vLLM read it. h_i: transformers' final-normed hidden state (what feeds the head), or fresh
random states; a chained step takes the previous step's norm_s output.

Float32 to 1e-4; bf16 against the float32 reference by relative error; FP8 against the dequantized float32 model,
exactly without the activations' e4m3 rounding and within the rounding's error with it.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from moeserve.core.forward_batch import ForwardMode
from tests.checkpoints import build_mtp_checkpoint
from tests.models.harness import ATOL, RTOL, MTPRunner, Runner, random_tokens, without_activation_rounding

close = dict(atol=ATOL, rtol=RTOL)
BF16_REL = 0.03  # |bf16 - float32 reference| / |reference| of the logits (measured 0.009)
BF16_TOP_GAP = 0.05  # the reference's max logit minus its logit at bf16's argmax (random logits tie within 0.006)
FP8_REL = 0.25  # with the activations' e4m3 rounding (test_fp8.py's bound for a whole model)


class Reference:
    """The MTP module of a checkpoint, from transformers' classes and the paper's equations."""

    def __init__(self, path: str):
        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        config = self.target.config
        self.L, self.eps = config.num_hidden_layers, config.rms_norm_eps
        deeper = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", num_hidden_layers=self.L + 1).eval()
        self.block = deeper.model.layers[self.L]
        tensors = load_file(f"{path}/model.safetensors")
        p = f"model.layers.{self.L}."
        self.enorm, self.hnorm = tensors[p + "enorm.weight"].float(), tensors[p + "hnorm.weight"].float()
        self.eh_proj = tensors[p + "eh_proj.weight"].float()
        self.shared_norm = tensors[p + "shared_head.norm.weight"].float()

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def head_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The main model's final-normed hidden states [n, H] of one sequence."""
        return self.target.model(torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def mtp(self, next_tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence of n MTP rows at positions 0..n-1 (row i: token t_{i+1}, hidden h_i), causal ->
        (logits [n, V], norm_s(h') [n, H])."""
        n = len(next_tokens)
        e = self.target.model.embed_tokens(torch.tensor(next_tokens))
        x = torch.cat([self.rms_norm(e, self.enorm), self.rms_norm(hidden, self.hnorm)], dim=-1) @ self.eh_proj.T
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        rope = self.target.model.rotary_emb(x[None], positions)
        y = self.block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=rope)
        y = y[0] if isinstance(y, tuple) else y
        h = self.rms_norm(y[0], self.shared_norm)
        return h @ self.target.lm_head.weight.T, h


@pytest.fixture(scope="module")
def reference(mtp_checkpoint) -> Reference:
    return Reference(mtp_checkpoint)


def _random_hidden(n: int, hidden_size: int, seed: int) -> torch.Tensor:
    return torch.randn(n, hidden_size, generator=torch.Generator().manual_seed(seed))


def test_one_request_random_hidden(mtp_checkpoint, reference):
    draft = MTPRunner(Runner(mtp_checkpoint))
    tokens, h = random_tokens(9, seed=11), _random_hidden(9, 64, seed=12)
    logits, h_next = draft.step(ForwardMode.EXTEND, [("a", tokens, h)])
    want_logits, want_h = reference.mtp(tokens, h)
    torch.testing.assert_close(logits, want_logits, **close)
    torch.testing.assert_close(h_next, want_h, **close)


@pytest.mark.parametrize("name", ["v3_no_q_lora", "v3_yarn", "v2_lite", "v2_groups"])
def test_other_deepseek_configs(name, tmp_path):
    """Without q_lora, YaRN, and the V2 family (softmax gates, greedy and group-limited) with an MTP layer."""
    path = build_mtp_checkpoint(name, tmp_path)
    draft = MTPRunner(Runner(path))
    tokens, h = random_tokens(9, seed=25), _random_hidden(9, 64, seed=26)
    logits, h_next = draft.step(ForwardMode.EXTEND, [("a", tokens, h)])
    want_logits, want_h = Reference(path).mtp(tokens, h)
    torch.testing.assert_close(logits, want_logits, **close)
    torch.testing.assert_close(h_next, want_h, **close)


def test_target_hidden_states_feed_it(mtp_checkpoint, reference):
    """The target's head_hidden_states are transformers' final-normed states; the MTP rows over a prompt pair
    h_i with t_{i+1}."""
    target = Runner(mtp_checkpoint)
    prompt = random_tokens(12, seed=13)
    batch = target.batch(ForwardMode.EXTEND, [("a", prompt)], return_all_logits=True)
    with torch.no_grad():
        h = target.model.head_hidden_states(batch.to(target.device))
    torch.testing.assert_close(h, reference.head_hidden(prompt), **close)
    logits, _ = MTPRunner(target).step(ForwardMode.EXTEND, [("a", prompt[1:], h[:-1])])
    torch.testing.assert_close(logits, reference.mtp(prompt[1:], reference.head_hidden(prompt)[:-1])[0], **close)


def test_ragged_extend_then_decode(mtp_checkpoint, reference):
    """Two requests of different lengths in one EXTEND, the second over a cached draft prefix, then one DECODE
    row each (MLA's absorbed decode over the MTP layer's own pool)."""
    draft = MTPRunner(Runner(mtp_checkpoint))
    toks = {"a": random_tokens(6, seed=14), "b": random_tokens(10, seed=15)}
    hid = {"a": _random_hidden(6, 64, seed=16), "b": _random_hidden(10, 64, seed=17)}
    draft.step(ForwardMode.EXTEND, [("b", toks["b"][:4], hid["b"][:4])])
    logits, _ = draft.step(ForwardMode.EXTEND, [("a", toks["a"][:5], hid["a"][:5]), ("b", toks["b"][4:9], hid["b"][4:9])])
    torch.testing.assert_close(logits[:5], reference.mtp(toks["a"][:5], hid["a"][:5])[0], **close)
    torch.testing.assert_close(logits[5:], reference.mtp(toks["b"][:9], hid["b"][:9])[0][4:], **close)
    last, _ = draft.step(ForwardMode.DECODE, [("a", toks["a"][5:], hid["a"][5:]), ("b", toks["b"][9:], hid["b"][9:])])
    torch.testing.assert_close(last[0], reference.mtp(toks["a"], hid["a"])[0][-1], **close)
    torch.testing.assert_close(last[1], reference.mtp(toks["b"], hid["b"])[0][-1], **close)


def test_chained_two_steps(mtp_checkpoint, reference):
    """A draft round as the loop runs it: the prompt's rows, then step 1 from the target's last hidden state and
    the target's token, then step 2 from step 1's token (its argmax) and hidden state."""
    target = Runner(mtp_checkpoint)
    prompt = random_tokens(10, seed=18)
    batch = target.batch(ForwardMode.EXTEND, [("a", prompt)], return_all_logits=True)
    with torch.no_grad():
        h = target.model.head_hidden_states(batch.to(target.device))
        t_next = int(target.model.head_logits(h[-1:]).argmax())
    draft = MTPRunner(target)
    draft.step(ForwardMode.EXTEND, [("a", prompt[1:], h[:-1])])
    logits1, h1 = draft.step(ForwardMode.DECODE, [("a", [t_next], h[-1:])])
    d1 = int(logits1.argmax())
    logits2, _ = draft.step(ForwardMode.DECODE, [("a", [d1], h1)])

    h_ref = reference.head_hidden(prompt)
    rows = prompt[1:] + [t_next]
    want1, want_h1 = reference.mtp(rows, h_ref)
    assert int(want1[-1].argmax()) == d1
    want2, _ = reference.mtp(rows + [d1], torch.cat([h_ref, want_h1[-1:]]))
    torch.testing.assert_close(logits1[0], want1[-1], **close)
    torch.testing.assert_close(logits2[0], want2[-1], **close)


def test_bfloat16(mtp_checkpoint, reference):
    draft = MTPRunner(Runner(mtp_checkpoint, dtype="bfloat16"))
    tokens, h = random_tokens(9, seed=19), _random_hidden(9, 64, seed=20)
    logits, _ = draft.step(ForwardMode.EXTEND, [("a", tokens, h)])
    want, _ = reference.mtp(tokens, h)
    assert logits.dtype == torch.float32
    assert float((logits - want).norm() / want.norm()) < BF16_REL
    at_ours = want.gather(1, logits.argmax(-1, keepdim=True))[:, 0]
    assert float((want.max(-1).values - at_ours).max()) < BF16_TOP_GAP


def test_fp8_exact_without_activation_rounding(fp8_mtp_checkpoint, monkeypatch):
    """Every FP8 weight, scale and block padding of the MTP layer is right: with the activations' rounding off,
    the FP8 layer is the dequantized float32 reference."""
    without_activation_rounding(monkeypatch)
    fp8, dequantized = fp8_mtp_checkpoint
    draft = MTPRunner(Runner(fp8))
    tokens, h = random_tokens(9, seed=21), _random_hidden(9, 256, seed=22)
    logits, h_next = draft.step(ForwardMode.EXTEND, [("a", tokens, h)])
    want, want_h = Reference(dequantized).mtp(tokens, h)
    torch.testing.assert_close(logits, want, **close)
    torch.testing.assert_close(h_next, want_h, **close)


def test_fp8_with_activation_rounding(fp8_mtp_checkpoint):
    fp8, dequantized = fp8_mtp_checkpoint
    draft = MTPRunner(Runner(fp8))
    tokens, h = random_tokens(9, seed=23), _random_hidden(9, 256, seed=24)
    logits, _ = draft.step(ForwardMode.EXTEND, [("a", tokens, h)])
    want, _ = Reference(dequantized).mtp(tokens, h)
    assert torch.isfinite(logits).all()
    assert float((logits - want).norm() / want.norm()) < FP8_REL
