"""PyTorch model family: one decoder-only transformer, six positional schemes."""
