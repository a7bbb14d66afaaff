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


def readme_python_blocks() -> list[str]:
    """The README's ```python blocks that run without a server (the OpenAI client one needs `dgemma serve`)."""
    blocks = re.findall(r"^```python\n(.*?)^```", _read("README.md"), re.S | re.M)
    return [b for b in blocks if "OpenAI(" not in b]


def test_the_readme_python_samples_run():
    # slow tier (tests/slow_tests.txt): the bundled model and a tiny engine compile, about 80 s on 2 cores
    import subprocess
    import sys

    blocks = readme_python_blocks()
    assert len(blocks) >= 2
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    for code in blocks:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=600)
        assert r.returncode == 0, f"{code}\n{r.stderr[-3000:]}"
        if "s9350814272=" in code:
            assert r.stdout.splitlines()[0] == "0122345789", r.stdout


def _cell_rule(cell: str):
    """A docs table cell as a rule target: `a` -> "a", `a` × `b` -> ("a", "b"), replicated -> None."""
    axes = re.findall(r"`(\w+)`", cell)
    if cell.strip() == "replicated":
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def test_the_logical_axes_table_lists_exactly_the_codes_names_and_rule_sets():
    # docs/tpu.md lists every logical axis name the model uses and what each built-in rule set maps it to;
    # tests/test_mesh_rules.py checks that LOGICAL_AXES are the model's own names
    from dgemma_jax.parallel.rules import LOGICAL_AXES, RULE_SETS, rules_for

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
