"""Checkpoint and tokenizer I/O."""

from dgemma_jax.io.hf import load_hf, save_hf
