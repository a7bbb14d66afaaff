"""A coarse reward for the GRPO run tests: many groups of the untrained tiny model score all equal."""


def first_char(prompt: str, completion: str, reference: str | None) -> float:
    """1.0 when the completion's first character is the reference's, else 0.0."""
    return float(bool(reference) and completion[:1] == reference[:1])
