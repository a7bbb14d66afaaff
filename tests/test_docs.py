"""The README stays a short read, and the documentation's links and commands point at things that exist.

The README is what a newcomer reads first: what the project is, install, run, serve / train / compile,
the API in brief and links. Measurements, tables, history and design notes live in docs/*.md and
benchmarks/README.md; these tests keep it that way and keep the links between them working.
"""

import argparse
import glob
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A five-minute read at roughly 250-280 words a minute, counting the words of the code blocks too
# (whitespace-separated, as `wc -w` counts them). Past this, material belongs in docs/.
README_MAX_WORDS = 1400

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _doc_files() -> list[str]:
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *docs, os.path.join("benchmarks", "README.md"), os.path.join("launch", "README.md")]


def relative_links(text: str) -> list[str]:
    """The targets of the markdown links outside code blocks that point into the repository."""
    prose = FENCE.sub("", text)
    return [t for t in LINK.findall(prose) if not t.startswith(EXTERNAL)]


def broken_links(rel: str, text: str) -> list[str]:
    """Relative links of the file `rel` that are anchored or do not resolve to an existing path."""
    bad = []
    base = os.path.dirname(os.path.join(ROOT, rel))
    for target in relative_links(text):
        if "#" in target:
            bad.append(f"{rel}: {target} (anchors are not checked: link the file and name the section)")
        elif not os.path.exists(os.path.normpath(os.path.join(base, target))):
            bad.append(f"{rel}: {target} (no such file)")
    return bad


def cli_subcommands() -> set[str]:
    from dgemma_jax.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def readme_subcommands(text: str) -> set[str]:
    """Every `dgemma WORD` the README mentions, in prose or in code."""
    return set(re.findall(r"\bdgemma ([a-z][a-z0-9_-]*)", text))


def test_readme_is_a_five_minute_read():
    words = len(_read("README.md").split())
    assert words <= README_MAX_WORDS, (f"README.md has {words} words, over {README_MAX_WORDS} (a five-minute read): "
                                       "move details to docs/ and link them")


def test_the_documentation_exists_and_the_readme_links_every_doc():
    files = _doc_files()
    assert len(files) > 2, files  # docs/*.md is not empty
    readme_links = {os.path.normpath(t) for t in relative_links(_read("README.md"))}
    unlinked = [f for f in files[1:] if os.path.normpath(f) not in readme_links]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_every_relative_link_resolves():
    bad = [b for rel in _doc_files() for b in broken_links(rel, _read(rel))]
    assert not bad, "\n".join(bad)


def test_the_link_checker_sees_a_broken_and_an_anchored_link():
    text = "[a](docs/serving.md) [b](docs/nope.md) [c](docs/tpu.md#fit) [d](https://x.org/y)\n```\nz[0](q)\n```\n"
    assert relative_links(text) == ["docs/serving.md", "docs/nope.md", "docs/tpu.md#fit"]
    assert [b.split(" ")[1] for b in broken_links("README.md", text)] == ["docs/nope.md", "docs/tpu.md#fit"]


def test_every_dgemma_command_in_the_readme_exists():
    mentioned = readme_subcommands(_read("README.md"))
    assert {"generate", "serve", "train", "compile"} <= mentioned, mentioned
    unknown = mentioned - cli_subcommands()
    assert not unknown, f"README.md mentions `dgemma {sorted(unknown)}`, which the CLI does not have"


def _section(text: str, heading: str) -> str:
    at = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", at + 1)
    return text[at: end if end >= 0 else len(text)]


def test_the_api_names_the_readme_shows_are_exported():
    import dgemma_jax

    readme = _read("README.md")
    table = [ln.split("|")[1] for ln in _section(readme, "Library API").splitlines()
             if ln.startswith("| `")]
    names = {n for cell in table for n in re.findall(r"`(\w+)`", cell)}
    assert len(names) >= 10, names
    attrs = set(re.findall(r"\bdg\.(\w+)", readme))
    assert not names - set(dgemma_jax.__all__), f"not in dgemma_jax.__all__: {names - set(dgemma_jax.__all__)}"
    assert not {a for a in attrs if not hasattr(dgemma_jax, a)}, attrs


# ---------------------------------------------------------------------------- the examples run
# Every ```python block of README.md and docs/*.md (and benchmarks/, launch/ READMEs) runs here, read from
# the files: the blocks of one file in order, in one namespace (a block may use an earlier block's names),
# from the repository root. A block that cannot run here (it needs a server, a TPU, a Hub download or a big
# checkpoint) is marked in the markdown on the line before it with
#     <!-- doc-test: skip (the reason) -->
# and such blocks stay a small minority (`test_few_examples_are_skipped`). A `print(...)  # -> ANSWER`
# line must print ANSWER. In ```bash blocks, each `dgemma generate ...  # -> ANSWER` line for a bundled
# model (no --checkpoint) runs too and must print ANSWER.

FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SKIP_MARK = re.compile(r"^<!-- doc-test: skip \(([^()]+)\) -->$")
ANSWER = re.compile(r"#\s*->\s*(\S+)")  # the answer: the first word after "# ->" (a remark may follow)


def examples(rel: str, text: str | None = None) -> list[dict]:
    """The fenced blocks of a markdown file: {file, line, lang, code, skip (the reason, or None)}."""
    text = _read(rel) if text is None else text
    out = []
    for m in FENCED.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        skip = SKIP_MARK.match(before)
        out.append({"file": rel, "line": text.count("\n", 0, m.start()) + 1, "lang": m.group(1),
                    "code": m.group(2), "skip": skip.group(1) if skip else None})
    return out


def _python_files() -> list[str]:
    return [f for f in _doc_files() if any(e["lang"] == "python" and not e["skip"] for e in examples(f))]


def stated_prints(code: str) -> list[str | None]:
    """Per top-level print(...) call of a block, in order: the answer its `# -> ANSWER` comment states (on
    the call's last line), or None."""
    import ast

    lines = code.splitlines()
    out = []
    for node in ast.parse(code).body:
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "print"):
            m = ANSWER.search(lines[node.end_lineno - 1])
            out.append(m.group(1) if m else None)
    return out


def test_the_example_reader_sees_blocks_skips_and_answers():
    text = ("a\n```python\nx = 1\n```\n<!-- doc-test: skip (needs a server) -->\n```python\nserve()\n```\n"
            "```bash\ndgemma generate --prompt \"s21=\"   # -> 12\n```\n<!-- doc-test: skip (no paren -->\n"
            "prose naming `<!-- doc-test: skip (the reason) -->`\n")
    ex = examples("X.md", text)
    assert [(e["lang"], e["line"], e["skip"]) for e in ex] == [("python", 2, None), ("python", 6, "needs a server"),
                                                              ("bash", 9, None)]
    assert stated_prints('print(f(1))  # -> 0159\nprint(g(\n  2))  # -> ab (remark)\nprint(3)\nh()  # -> no\n') == [
        "0159", "ab", None]
    assert len(bad_skip_marks(text)) == 1


def bad_skip_marks(text: str) -> list[str]:
    """`doc-test` comments (lines starting `<!--`) that are not the documented mark right before a block."""
    lines = text.splitlines()
    bad = []
    for i, ln in enumerate(lines):
        marked = SKIP_MARK.match(ln.strip()) and i + 1 < len(lines) and lines[i + 1].startswith("```")
        if ln.lstrip().startswith("<!--") and "doc-test" in ln and not marked:
            bad.append(ln)
    return bad


def test_few_examples_are_skipped():
    blocks = [e for f in _doc_files() for e in examples(f) if e["lang"] == "python"]
    skipped = [f"{e['file']}:{e['line']} ({e['skip']})" for e in blocks if e["skip"]]
    assert len(blocks) >= 8, len(blocks)
    assert 4 * len(skipped) <= len(blocks), f"{len(skipped)} of {len(blocks)} python examples skipped: {skipped}"
    bad = [b for f in _doc_files() for b in bad_skip_marks(_read(f))]
    assert not bad, f"doc-test marks not in the form '<!-- doc-test: skip (reason) -->' right before a block: {bad}"


@pytest.mark.parametrize("rel", _python_files())
def test_the_python_examples_run(rel, monkeypatch, capsys):
    # slow tier (tests/slow_tests.txt): the bundled models and tiny engines compile (programs shared in-process)
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__doc_example__"}
    ran = 0
    for e in examples(rel):
        if e["lang"] != "python" or e["skip"]:
            continue
        code = compile(e["code"], f"{rel}:{e['line']}", "exec")
        capsys.readouterr()
        exec(code, namespace)
        ran += 1
        printed = capsys.readouterr().out.splitlines()
        stated = stated_prints(e["code"])
        assert len(printed) == len(stated), (f"{rel}:{e['line']}: {len(stated)} print calls, {len(printed)} lines "
                                             f"printed: {printed}")
        wrong = [(want, got) for want, got in zip(stated, printed) if want is not None and want != got.strip()]
        assert not wrong, f"{rel}:{e['line']}: (stated, printed) {wrong}"
    assert ran


def bundled_commands() -> list[tuple[str, str, str]]:
    """(where, command, answer) of every `dgemma generate ... # -> ANSWER` line in a bash block that runs a
    bundled model (no --checkpoint)."""
    out = []
    for f in _doc_files():
        for e in examples(f):
            if e["lang"] != "bash" or e["skip"]:
                continue
            for k, ln in enumerate(e["code"].splitlines()):
                m = ANSWER.search(ln)
                if ln.startswith("dgemma generate ") and m and "--checkpoint" not in ln:
                    out.append((f"{f}:{e['line'] + 1 + k}", ln[: m.start()].strip(), m.group(1)))
    return out


def test_the_bundled_model_commands_give_their_stated_answers(monkeypatch, capsys):
    # slow tier: the two bundled models compile in-process
    import shlex

    from dgemma_jax.cli import main

    monkeypatch.chdir(ROOT)
    commands = bundled_commands()
    assert {c for _, c, _ in commands} >= {'dgemma generate --prompt "s9350814272="',
                                           'dgemma generate --image examples/digits.png --prompt "sort the digits '
                                           'in the image"'}, commands
    for where, command, answer in commands:
        capsys.readouterr()
        rc = main(shlex.split(command)[1:])
        out = capsys.readouterr()
        assert rc == 0, f"{where}: {command}\n{out.err[-2000:]}"
        assert out.out.strip().splitlines()[-1] == answer, f"{where}: {command} printed {out.out!r}, not {answer}"


def _cell_rule(cell: str):
    """A docs table cell as a rule target: `a` -> "a", `a` × `b` -> ("a", "b"), replicated -> None."""
    axes = re.findall(r"`(\w+)`", cell)
    if cell.strip() == "replicated":
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def test_the_logical_axes_table_lists_exactly_the_codes_names_and_rule_sets():
    # docs/tpu.md lists every logical axis name the model uses and what each built-in rule set maps it to;
    # tests/test_mesh_rules.py checks that LOGICAL_AXES are the model's own names
    from dgemma_jax.axis_rules import LOGICAL_AXES, RULE_SETS, rules_for

    section = _section(_read("docs/tpu.md"), "Meshes, logical axes and rule sets")
    header = next(ln for ln in section.splitlines() if ln.startswith("| logical axis |"))
    sets = re.findall(r"`(\w+)`", header)
    assert sets == list(RULE_SETS), sets
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines()
            if re.match(r"\| `\w+` \|", ln) and len(ln.split("|")) == len(sets) + 4]
    names = [re.fullmatch(r"`(\w+)`", r[0]).group(1) for r in rows]
    assert sorted(names) == sorted(LOGICAL_AXES) and len(names) == len(set(names)), names
    for row, name in zip(rows, names):
        for set_name, cell in zip(sets, row[2:]):
            assert _cell_rule(cell) == dict(RULE_SETS[set_name]).get(name), (name, set_name, cell)
    # the rules-file example is a valid rule set
    (example,) = re.findall(r"^```json\n(.*?)^```", section, re.S | re.M)
    assert dict(rules_for(json.loads(example)))["experts"] == "expert"


def _public_callables():
    """(name, function) of the package's public functions (`dgemma_jax.__all__`) and the public
    methods of its two front doors, `Engine` and `DiffusionGemma` (defined there, not inherited)."""
    import inspect

    import dgemma_jax
    out = []
    for name in dgemma_jax.__all__:
        obj = getattr(dgemma_jax, name)
        if inspect.isfunction(obj):
            out.append((name, obj))
    for cls in (dgemma_jax.Engine, dgemma_jax.DiffusionGemma):
        for name, member in vars(cls).items():
            fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
            if not name.startswith("_") and inspect.isfunction(fn):
                out.append((f"{cls.__name__}.{name}", fn))
    return out


def _undocumented(fn) -> list[str]:
    """The sections a public function's docstring lacks: Args (when it takes any) and Returns."""
    import inspect
    doc = inspect.getdoc(fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    return [s for s, needed in (("Args:", bool(params)), ("Returns:", True)) if needed and s not in doc]


def test_public_functions_document_their_arguments_and_results():
    missing = {name: gaps for name, fn in _public_callables() if (gaps := _undocumented(fn))}
    assert len(_public_callables()) > 25
    assert not missing, f"public functions without Args / Returns sections: {missing}"


def test_the_docstring_check_sees_a_prose_docstring():
    def prose(x, y):
        """Adds x to y and returns the sum."""
        return x + y

    def sectioned(x):
        """One.

        Args:
          x: a number.
        Returns:
          x.
        """
        return x

    assert _undocumented(prose) == ["Args:", "Returns:"]
    assert _undocumented(sectioned) == []


def test_api_shape_comments_say_the_budget_of_the_call_above():
    """docs/api.md said `out.tokens  # [B, 32]` under a call with max_new_tokens=16: every `# [B, N]`
    comment on a generated-tokens line names the max_new_tokens of the nearest call above it."""
    import re

    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        lines = f.read().splitlines()
    checked = 0
    for i, line in enumerate(lines):
        m = re.search(r"(tokens|my_tokens)\b.*#\s*\[B, (\d+)\]", line)
        if not m:
            continue
        budget = next(re.search(r"max_new_tokens=(\d+)", lines[j]) for j in range(i, -1, -1)
                      if re.search(r"max_new_tokens=(\d+)", lines[j]))
        assert budget.group(1) == m.group(2), f"docs/api.md line {i + 1}: {line.strip()}"
        checked += 1
    assert checked >= 2
    assert "`engine.inputs.bucket_length`" not in "\n".join(lines)  # a module function, not the engine's


def test_readme_says_how_long_the_cpu_training_command_takes():
    """The README's from-scratch CPU training command ran for ~40-50 minutes without saying so."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    at = text.index("configs/train_bundled.py --set train.workdir=/tmp/digits")
    after = text[at:at + 800]
    assert re.search(r"\d+ min", after.splitlines()[0]), after
    with open(os.path.join(ROOT, "docs", "bundled_model.md")) as f:
        source = f.read()
    assert "2927 s of training (49 min)" in source and "49 min" in after  # the number the docs measured
