"""KV transfer backends: one interface (base.py), one file per backend."""
