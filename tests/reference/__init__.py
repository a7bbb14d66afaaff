"""Test-only helpers for dgemma_jax.

Nothing here is imported by ``import dgemma_jax``.  ``tests.reference.hf_reference`` needs the optional
``[ref]`` extra (torch + transformers) and must be imported explicitly by tests and tools that compare against
the Hugging Face reference implementation.
"""
