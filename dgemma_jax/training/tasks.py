"""Checkable synthetic tasks the project generates itself (no downloads).

Each task maps a random problem to a (prompt, answer) pair of strings; a model's answer is checked
by exact string match. A `TaskMix` draws from several tasks, each prompt starting with a one-letter
task prefix so one model can learn them all::

    sort     "s" + digits + "="          -> the digits sorted ascending      s3141592=  -> 1123459
    reverse  "r" + digits + "="          -> the digits reversed              r1234=     -> 4321
    add      "a" + A + "+" + B + "="     -> A + B in decimal                 a123+989=  -> 1112

Lengths are drawn uniformly from [min_len, max_len] (number of input digits; for `add` the number of
digits of each operand). Answers longer than one canvas exercise multi-canvas generation.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dgemma_jax.io.char_tokenizer import CharTokenizer

DIGITS = "0123456789"
TASK_PREFIX = {"sort": "s", "reverse": "r", "add": "a"}
TASK_CHARS = DIGITS + "=+" + "".join(TASK_PREFIX.values())


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    min_len: int
    max_len: int
    weight: float = 1.0

    def __post_init__(self):
        if self.name not in TASK_PREFIX:
            raise ValueError(f"unknown task {self.name!r}; choose from {sorted(TASK_PREFIX)}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"task {self.name}: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        n = int(rng.integers(self.min_len, self.max_len + 1))
        p = TASK_PREFIX[self.name]
        if self.name == "add":
            a = int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10 ** n))
            b = int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10 ** n))
            return f"{p}{a}+{b}=", str(a + b)
        digits = "".join(DIGITS[int(d)] for d in rng.integers(0, 10, size=n))
        if self.name == "sort":
            return f"{p}{digits}=", "".join(sorted(digits))
        return f"{p}{digits}=", digits[::-1]

    def max_prompt_chars(self) -> int:
        return 2 + (2 * self.max_len + 1 if self.name == "add" else self.max_len)

    def max_answer_chars(self) -> int:
        return self.max_len + 1 if self.name == "add" else self.max_len


class TaskMix:
    """A weighted mixture of tasks; `sample(rng)` -> (prompt, answer)."""

    def __init__(self, tasks: Sequence[Task]):
        if not tasks:
            raise ValueError("TaskMix needs at least one task")
        self.tasks = tuple(tasks)
        w = np.asarray([t.weight for t in self.tasks], np.float64)
        self.probs = w / w.sum()

    @classmethod
    def from_config(cls, specs) -> "TaskMix":
        """specs: a sequence of dicts / ConfigDicts with name, min_len, max_len[, weight]."""
        return cls([Task(str(s["name"]), int(s["min_len"]), int(s["max_len"]), float(s.get("weight", 1.0)))
                    for s in specs])

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        i = int(rng.choice(len(self.tasks), p=self.probs)) if len(self.tasks) > 1 else 0
        return self.tasks[i].sample(rng)

    def max_prompt_chars(self) -> int:
        return max(t.max_prompt_chars() for t in self.tasks)

    def max_answer_chars(self) -> int:
        return max(t.max_answer_chars() for t in self.tasks)


def task_tokenizer() -> CharTokenizer:
    """The character vocabulary of all tasks (3 specials + 15 characters = 18 ids)."""
    return CharTokenizer(TASK_CHARS)
