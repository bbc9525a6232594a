"""Prefill/decode disaggregation: the bootstrap server, the per-request states on both sides, KV transfer."""
