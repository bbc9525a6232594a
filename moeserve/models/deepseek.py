"""DeepSeek-V2 and DeepSeek-V3: MLA attention, then a dense MLP (first_k_dense_replace layers) or an MoE layer
with shared experts and a grouped gate.

Both use the same modules; what differs comes from the config:
- V3: sigmoid scores + e_score_correction_bias (noaux_tc), groups ranked by their top-2 scores, weights
  renormalized then x routed_scaling_factor (2.5); rope pairs interleaved (rope_interleave).
- V2: softmax scores, greedy (V2-Lite) or group_limited_greedy (groups ranked by their best expert);
  YaRN with mscale folded into the softmax scale.
NOTE: transformers' DeepseekV2TopkRouter ignores norm_topk_prob; we honour it (as DeepSeek's own code does).
Released V2 checkpoints have norm_topk_prob false, where the two agree.
MTP layers (model.layers.{num_hidden_layers}+) are not built; the loader skips their tensors.
"""

from __future__ import annotations

from moeserve.models.decoder import CausalLM


class DeepseekV3ForCausalLM(CausalLM):
    pass


class DeepseekV2ForCausalLM(CausalLM):
    pass
