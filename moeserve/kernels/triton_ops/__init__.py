"""Triton kernels, one op per file (see moeserve/kernels/__init__.py). Importing a module here imports Triton."""
