"""Verifiable rewards for RL recipes (`rl.reward = "dgemma_jax.training.rewards:<name>"`).

A reward is any importable function f(prompt: str, completion: str, reference: str | None) -> float;
the completion is the decoded answer before its first EOS, the reference the problem's answer (a task's
answer, or the JSON line's response) or None.
"""

from __future__ import annotations


def exact_match(prompt: str, completion: str, reference: str | None) -> float:
    """1.0 when the completion is exactly the reference answer, else 0.0."""
    if reference is None:
        raise ValueError("the exact_match reward needs a reference answer for every prompt (data's response_key)")
    return float(completion == reference)


def char_accuracy(prompt: str, completion: str, reference: str | None) -> float:
    """Fraction of the reference's characters matched position by position (a length mismatch counts as
    misses): a denser signal than exact match for long answers."""
    if reference is None:
        raise ValueError("the char_accuracy reward needs a reference answer for every prompt")
    if not reference:
        return float(completion == reference)
    hits = sum(a == b for a, b in zip(completion, reference))
    return hits / max(len(reference), len(completion))
