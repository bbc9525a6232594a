"""Speculative decoding on a rank: draft k tokens cheaply, verify them in one target forward, keep what the target
would have produced (docs/ARCHITECTURE.md, "a speculative algorithm")."""
