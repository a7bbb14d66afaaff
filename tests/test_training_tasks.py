"""The digit tasks' input kinds (dgemma_jax/training/tasks.py): each generator makes what its name
says, the mixture is deterministic per seed and follows its weights, the default (no `kinds`) draws
exactly as before the kinds existed, and the bundled recipe's mixture is accepted."""

import os

import numpy as np
import pytest

from dgemma_jax.training.data import Layout, TaskSource
from dgemma_jax.training.tasks import DIGIT_KINDS, Task, TaskMix, kind_problems, task_from_spec, task_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SORT = dict(name="sort", min_len=9, max_len=16)


def _input(prompt: str) -> str:
    assert prompt[0] == "s" and prompt[-1] == "="
    return prompt[1:-1]


@pytest.mark.parametrize("kind", DIGIT_KINDS)
def test_each_kind_makes_what_its_name_says(kind):
    pairs = kind_problems(SORT, kind, 300, seed=7)
    assert pairs == kind_problems(SORT, kind, 300, seed=7)                  # deterministic per seed
    assert pairs != kind_problems(SORT, kind, 300, seed=8)
    lengths = set()
    for prompt, answer in pairs:
        x = _input(prompt)
        lengths.add(len(x))
        assert x.isdigit() and 9 <= len(x) <= 16
        assert answer == "".join(sorted(x))
        counts = np.bincount([int(c) for c in x], minlength=10)
        if kind == "same":
            assert len(set(x)) == 1
        elif kind == "dominant":
            assert len(x) / 2 < counts.max() < len(x)                      # a strict majority, not all
        elif kind == "two":
            assert len(set(x)) == 2
        elif kind == "leading_zeros":
            assert x.startswith("0")
        elif kind == "sorted":
            assert x == answer
        elif kind == "reversed":
            assert x == answer[::-1]
    assert lengths == set(range(9, 17))                                     # every length shows up
    if kind == "random":                                                    # uniform digits: no bias
        assert np.mean([len(set(_input(p))) for p, _ in pairs]) > 6


def test_default_generator_is_unchanged():
    """No `kinds`: the stream is the one the generator drew before the kinds existed (pinned)."""
    mix = TaskMix.from_config([SORT])
    assert mix.sample(np.random.default_rng([0, 5])) == ("s38534333176203=", "01233333345678")
    assert Task("sort", 9, 16).kinds is None


def test_mixture_follows_its_weights_and_is_deterministic():
    weights = dict(random=0.3, same=0.1, dominant=0.2, two=0.2, leading_zeros=0.1, sorted=0.05, reversed=0.05)
    spec = dict(SORT, kinds=weights)
    # the dict's order does not matter (canonical DIGIT_KINDS order)
    assert task_from_spec(spec) == task_from_spec(dict(SORT, kinds=dict(reversed(list(weights.items())))))
    lay = Layout(prompt_length=19, num_canvases=3, canvas_length=8)
    src = TaskSource(TaskMix.from_config([spec]), task_tokenizer(), lay, batch_size=64, seed=0)
    strings = [s for i in range(40) for s in src.example_strings(i)]
    assert strings[:64] == src.example_strings(0)
    xs = [_input(p) for p, _ in strings]
    assert all(a == "".join(sorted(_input(p))) for p, a in strings)
    n = len(xs)
    same = np.mean([len(set(x)) == 1 for x in xs])
    two = np.mean([len(set(x)) == 2 for x in xs])
    assert abs(same - 0.1) < 0.03 and abs(two - 0.2) < 0.04, (same, two)
    only = TaskMix.from_config([dict(SORT, kinds=dict(same=1.0, random=0.0))])
    rng = np.random.default_rng(3)
    assert all(len(set(_input(only.sample(rng)[0]))) == 1 for _ in range(50))
    assert n == 64 * 40


def test_bad_kinds_are_errors():
    with pytest.raises(ValueError, match="unknown kinds"):
        task_from_spec(dict(SORT, kinds=dict(random=1.0, repeated=1.0)))
    with pytest.raises(ValueError, match="sort, reverse"):
        task_from_spec(dict(name="add", min_len=2, max_len=3, kinds=dict(random=1.0)))
    with pytest.raises(ValueError, match="positive sum"):
        task_from_spec(dict(SORT, kinds=dict(random=0.0)))
    with pytest.raises(ValueError, match="unknown keys"):
        task_from_spec(dict(SORT, kind="same"))
    with pytest.raises(ValueError, match="unknown digit kind"):
        kind_problems(SORT, "palindrome", 3, 0)


def test_bundled_recipe_mixture_is_accepted():
    """The recipe's kinds parse, an override of data.tasks with kinds passes the key validation, and the
    per-category eval stream is not the training stream even with eval seed == data seed."""
    from dgemma_jax.training.recipe import plain
    from dgemma_jax.training.train import load_config

    cfg = load_config(os.path.join(ROOT, "configs", "train_bundled.py"),
                      {"data.tasks": [dict(SORT, kinds=dict(same=1.0, random=1.0))], "train.num_steps": 3})
    assert TaskMix.from_config(plain(cfg.data)["tasks"]).tasks[0].kinds == (("random", 1.0), ("same", 1.0))
    recipe = load_config(os.path.join(ROOT, "configs", "train_bundled.py"))
    task = TaskMix.from_config(plain(recipe.data)["tasks"]).tasks[0]
    assert {k for k, _ in task.kinds} == set(DIGIT_KINDS)
    lay = Layout(prompt_length=19, num_canvases=3, canvas_length=8)
    train = {p for i in range(3) for p, _ in TaskSource(TaskMix([Task("sort", 9, 16)]), task_tokenizer(), lay, 64,
                                                         seed=5).example_strings(i)}
    assert not train & {p for p, _ in kind_problems(SORT, "random", 64, seed=5)}
