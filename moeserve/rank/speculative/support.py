"""What speculative decoding runs with today, and what it refuses by name (never accepted and ignored)."""

from __future__ import annotations

from moeserve.args import PDRole, ServerArgs


def unsupported_with_speculation(args: ServerArgs) -> str | None:
    """The first flag set in `args` that speculative decoding does not run with yet, as an error message; None
    when every flag set is supported. The round runs steps back to back (in CUDA graphs where model_runner
    captures them), on any layout of attention groups (a group that does not draft in a step joins the draft
    forwards' collectives, round.join_drafts)."""
    refused = [
        (args.enable_mixed_chunk, "--enable-mixed-chunk"),
        # a PD prefill server drafts over each prompt after its step (round.draft_prompt), outside the step
        # pipeline's collectives that other DP groups join
        (args.disagg.role is not PDRole.NULL and args.enable_dp_attention,
         "--disaggregation-mode and --enable-dp-attention"),
        (args.enable_torch_compile, "--enable-torch-compile"),
        (args.enable_static_shape_extend, "--enable-static-shape-extend"),  # its extends run forward_hidden
        (args.enable_eplb or args.expert_distribution_recorder_mode is not None,
         "--enable-eplb and --expert-distribution-recorder-mode"),
    ]
    for on, flag in refused:
        if on:
            return f"--speculative-algorithm with {flag} is not supported yet"
    return None
