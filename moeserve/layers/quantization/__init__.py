"""Weight formats other than the model's dtype: DeepSeek's block FP8 (fp8_*.py; `to_fp8` swaps a built model's
layers for their FP8 twins)."""
