"""moeserve: serve huge Mixture-of-Experts language models."""
