"""Exceptions shared by the command line and the library, and reading user files with errors that
name the file."""

import json
import sys
import warnings


def read_json(path: str, require: tuple = ()) -> dict:
    """A JSON object from `path`; unreadable or malformed JSON, a non-object or a missing required key
    is a ValueError that names the file (not a bare decoder message)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {path!r} as JSON ({e}); the file is damaged: restore or re-download it") \
            from e
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} holds a JSON {type(data).__name__}, expected an object")
    missing = [k for k in require if k not in data]
    if missing:
        raise ValueError(f"{path!r} lacks the required key(s) {missing}; the file is damaged: restore or re-write it")
    return data


class UsageError(Exception):
    """A problem with the user's input: the `dgemma` command reports it in one line, exit code 2."""


class NonFiniteLogits(ValueError):
    """The model produced NaN/Inf logits (its weights or activations are not finite): the generated
    tokens are not its answer. `Engine.generate(..., nonfinite="raise")` and `DiffusionGemma` raise it."""


class DgemmaWarning(UserWarning):
    """Something the user should know about a result that is not an error (a canvas length the model
    was not trained for, an output cut short by the context, a checkpoint without a tokenizer). The
    `dgemma` command prints each as one line `dgemma: warning: ...`."""


def print_warnings_as_lines(stream=None) -> None:
    """Show `DgemmaWarning`s as `dgemma: warning: <message>` lines (no file/line prefix, no source
    line); other warnings keep Python's format."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DgemmaWarning):
            out = file or stream or sys.stderr
            out.write(f"dgemma: warning: {message}\n")
            out.flush()
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.simplefilter("always", DgemmaWarning)
