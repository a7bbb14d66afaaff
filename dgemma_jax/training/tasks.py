"""Checkable synthetic tasks the project generates itself (no downloads).

Each task maps a random problem to a (prompt, answer) pair of strings; a model's answer is checked
by exact string match. A `TaskMix` draws from several tasks, each prompt starting with a one-letter
task prefix so one model can learn them all::

    sort     "s" + digits + "="          -> the digits sorted ascending      s3141592=  -> 1123459
    reverse  "r" + digits + "="          -> the digits reversed              r1234=     -> 4321
    add      "a" + A + "+" + B + "="     -> A + B in decimal                 a123+989=  -> 1112

Lengths are drawn uniformly from [min_len, max_len] (number of input digits; for `add` the number of
digits of each operand). Answers longer than one canvas exercise multi-canvas generation.

Input kinds (`sort` and `reverse`): by default every input digit is uniform, so inputs with long runs
of one digit are rare (a 9-digit all-same string has probability 1e-8). `kinds={kind: weight}` draws
each problem's input from a weighted mixture of these generators instead (`DIGIT_KINDS`)::

    random         uniform digits (the default generator)
    same           one digit repeated                                   777777777777
    dominant       one digit in more than half the positions, the rest   5535555955
                   other digits
    two            exactly two distinct digits, each at least once       3883388838
    leading_zeros  uniform digits with a prefix of 1..n//2 zeros         000471958302
    sorted         already ascending                                     0112345789
    reversed       descending (the sort answer reversed)                 9875432110

`kind_problems(spec, kind, n, seed)` draws n problems of one kind (a held-out per-category eval).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dgemma_jax.io.char_tokenizer import CharTokenizer

DIGITS = "0123456789"
TASK_PREFIX = {"sort": "s", "reverse": "r", "add": "a"}
TASK_CHARS = DIGITS + "=+" + "".join(TASK_PREFIX.values())
DIGIT_KINDS = ("random", "same", "dominant", "two", "leading_zeros", "sorted", "reversed")


def digit_string(rng: np.random.Generator, n: int, kind: str = "random") -> str:
    """n digits from generator `kind` (one of DIGIT_KINDS); n >= 2 for dominant/two/leading_zeros."""
    if kind == "random":
        return "".join(DIGITS[int(d)] for d in rng.integers(0, 10, size=n))
    if kind == "same":
        return DIGITS[int(rng.integers(0, 10))] * n
    if kind == "dominant":
        d = int(rng.integers(0, 10))
        k = int(rng.integers(n // 2 + 1, n))                  # copies of d: a strict majority, not all
        others = (d + rng.integers(1, 10, size=n - k)) % 10    # any digit but d
        ds = np.concatenate([np.full(k, d), others])
        return "".join(DIGITS[int(x)] for x in rng.permutation(ds))
    if kind == "two":
        a, b = (int(x) for x in rng.choice(10, size=2, replace=False))
        k = int(rng.integers(1, n))                           # copies of a; both digits present
        ds = np.concatenate([np.full(k, a), np.full(n - k, b)])
        return "".join(DIGITS[int(x)] for x in rng.permutation(ds))
    if kind == "leading_zeros":
        z = int(rng.integers(1, max(1, n // 2) + 1))
        return "0" * z + digit_string(rng, n - z)
    if kind == "sorted":
        return "".join(sorted(digit_string(rng, n)))
    if kind == "reversed":
        return "".join(sorted(digit_string(rng, n), reverse=True))
    raise ValueError(f"unknown digit kind {kind!r}; choose from {DIGIT_KINDS}")


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    min_len: int
    max_len: int
    weight: float = 1.0
    kinds: tuple[tuple[str, float], ...] | None = None    # ((kind, weight), ...) in DIGIT_KINDS order

    def __post_init__(self):
        if self.name not in TASK_PREFIX:
            raise ValueError(f"unknown task {self.name!r}; choose from {sorted(TASK_PREFIX)}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"task {self.name}: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.kinds is not None:
            kinds = dict(self.kinds.items() if isinstance(self.kinds, dict) else self.kinds)
            if self.name == "add":
                raise ValueError("task add: `kinds` applies to the digit-string tasks (sort, reverse) only")
            bad = sorted(set(kinds) - set(DIGIT_KINDS))
            if bad:
                raise ValueError(f"task {self.name}: unknown kinds {bad}; choose from {DIGIT_KINDS}")
            if any(float(w) < 0 for w in kinds.values()) or not sum(float(w) for w in kinds.values()) > 0:
                raise ValueError(f"task {self.name}: kind weights must be >= 0 with a positive sum, got {kinds}")
            if self.min_len < 2 and any(k in kinds for k in ("dominant", "two", "leading_zeros")):
                raise ValueError(f"task {self.name}: kinds dominant/two/leading_zeros need min_len >= 2")
            # canonical order (DIGIT_KINDS), so the stream does not depend on how the dict was written
            object.__setattr__(self, "kinds", tuple((k, float(kinds[k])) for k in DIGIT_KINDS if k in kinds))

    def sample(self, rng: np.random.Generator, kind: str | None = None) -> tuple[str, str]:
        """One (prompt, answer). Without `kinds` (and `kind`) the input digits are uniform; with
        `kinds` the kind is drawn first from its weights; `kind` forces one generator."""
        if kind is None and self.kinds is not None:
            w = np.asarray([x for _, x in self.kinds], np.float64)
            kind = self.kinds[int(rng.choice(len(w), p=w / w.sum()))][0]
        n = int(rng.integers(self.min_len, self.max_len + 1))
        p = TASK_PREFIX[self.name]
        if self.name == "add":
            if kind not in (None, "random"):
                raise ValueError("task add has no digit kinds")
            a = int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10 ** n))
            b = int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10 ** n))
            return f"{p}{a}+{b}=", str(a + b)
        digits = digit_string(rng, n, kind or "random")
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
        """specs: a sequence of dicts / ConfigDicts with name, min_len, max_len[, weight][, kinds]
        (kinds: {kind: weight}, see DIGIT_KINDS)."""
        return cls([task_from_spec(s) for s in specs])

    def sample(self, rng: np.random.Generator) -> tuple[str, str]:
        i = int(rng.choice(len(self.tasks), p=self.probs)) if len(self.tasks) > 1 else 0
        return self.tasks[i].sample(rng)

    def max_prompt_chars(self) -> int:
        return max(t.max_prompt_chars() for t in self.tasks)

    def max_answer_chars(self) -> int:
        return max(t.max_answer_chars() for t in self.tasks)


def task_from_spec(s) -> Task:
    """A Task from a dict / ConfigDict {name, min_len, max_len[, weight][, kinds]}."""
    unknown = sorted(set(s.keys()) - {"name", "min_len", "max_len", "weight", "kinds"})
    if unknown:
        raise ValueError(f"task spec {dict(s)}: unknown keys {unknown} (name, min_len, max_len, weight, kinds)")
    kinds = s.get("kinds")
    if kinds is not None:
        kinds = tuple((str(k), float(w)) for k, w in dict(kinds).items())
    return Task(str(s["name"]), int(s["min_len"]), int(s["max_len"]), float(s.get("weight", 1.0)), kinds)


def kind_problems(spec, kind: str, n: int, seed: int) -> list[tuple[str, str]]:
    """n (prompt, answer) problems whose inputs all come from generator `kind` (DIGIT_KINDS), with
    the task's lengths; `spec` is a Task or a task spec dict. A held-out per-category eval: the stream
    default_rng([seed, 99, 1 + index of kind]) is one that training (default_rng([data_seed, batch]))
    never draws from, whatever the seeds."""
    task = spec if isinstance(spec, Task) else task_from_spec(spec)
    if kind not in DIGIT_KINDS:
        raise ValueError(f"unknown digit kind {kind!r}; choose from {DIGIT_KINDS}")
    rng = np.random.default_rng([int(seed), 99, DIGIT_KINDS.index(kind) + 1])   # +1: a trailing 0 is dropped
    return [task.sample(rng, kind) for _ in range(int(n))]


def task_tokenizer() -> CharTokenizer:
    """The character vocabulary of all tasks (3 specials + 15 characters = 18 ids)."""
    return CharTokenizer(TASK_CHARS)
