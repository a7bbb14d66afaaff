#!/usr/bin/env python3
"""Write, check or run the Colab TPU notebook `launch/colab_tpu.ipynb`.

The cells are defined here (the notebook is generated, so edit this file and regenerate):

    python launch/make_colab.py                 # (re)write launch/colab_tpu.ipynb
    python launch/make_colab.py --check         # validate the notebook and print its code cells
    python launch/make_colab.py --run --set MAX_NEW_TOKENS=32 --set STEPS=8
                                                # execute the code cells here (magics skipped)

`--check` needs no Jupyter packages: it checks the nbformat 4 structure by hand (top-level keys,
cell types, ids, sources, outputs), that every code cell compiles once `!`/`%` lines are set
aside, and that the file matches what this script generates. Exit status 1 lists the problems.
`--run` runs the code cells in one namespace, like a notebook kernel would, after applying the
`--set NAME=VALUE` overrides to the settings cell; with the default empty CHECKPOINT it exercises
the small-model fallback on whatever JAX backend is present.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "colab_tpu.ipynb"

# ----------------------------------------------------------------------------- the cells
INTRO = """\
# DiffusionGemma on a Colab TPU (dgemma_jax)

[dgemma_jax](https://github.com/YOUR_ORG/dgemma_jax) runs DiffusionGemma, a text diffusion model
with a Gemma 4 mixture-of-experts backbone, in JAX. Instead of writing one token at a time it
denoises a whole *canvas* of tokens (256 for the released model) in parallel, over up to 48 steps.

1. **Runtime > Change runtime type > TPU** (v5e-1, v6e-1 or v2-8). The notebook also runs on a CPU
   or GPU runtime, more slowly.
2. Fill in the settings below and run all cells.

Which model fits: the released `diffusiongemma-26B-A4B-it` holds 25 B parameters, about 51 GB in
bfloat16, more than one Colab TPU chip has (v5e: 16 GB, v6e: 32 GB). Run it on a v5e-8 / v6e-8 /
v5p-8 with `launch/tpu_vm.sh` (see `launch/README.md`). Here, point `CHECKPOINT` at a smaller
DiffusionGemma checkpoint, or leave it empty to use the small model bundled with dgemma_jax
(a random tiny model if this version bundles none: the pipeline runs, the text is noise).
"""

SETTINGS = """\
# @title Settings { display-mode: "form" }
# Where dgemma_jax comes from: a local copy (uploaded, or on Drive) wins over the git URL.
REPO_URL = "https://github.com/YOUR_ORG/dgemma_jax"  # @param {type:"string"}
REPO_REF = "main"  # @param {type:"string"}
LOCAL_COPY = "/content/dgemma_jax"  # @param {type:"string"}
# A Hugging Face DiffusionGemma checkpoint: a local directory (config.json, *.safetensors,
# tokenizer files), a gs:// directory or a Hub repo id. Empty: the bundled small model.
CHECKPOINT = ""  # @param {type:"string"}
PROMPT = "Explain in two sentences how a diffusion language model writes text."  # @param {type:"string"}
MAX_NEW_TOKENS = 256  # @param {type:"integer"}
STEPS = 48  # @param {type:"integer"}
SEED = 0  # @param {type:"integer"}
"""

INSTALL_MD = """\
## Install

`pip install "dgemma_jax[tpu] @ git+REPO_URL@REPO_REF"`, or an editable install of `LOCAL_COPY`
when that directory exists. `[tpu]` pins `jax[tpu]` (with libtpu); it also installs fine on CPU
and GPU runtimes. Nothing is installed when `dgemma_jax` is already importable. If Colab had
already imported another jax version, restart the session (Runtime > Restart session) after this
cell and skip it the second time.
"""

INSTALL = """\
import importlib
import importlib.util
import os
import subprocess
import sys


def pip_install(*args):
    print("pip install", *args)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args], check=True)


if importlib.util.find_spec("dgemma_jax") is not None:
    print("dgemma_jax is already installed")
elif os.path.isfile(os.path.join(LOCAL_COPY, "setup.py")):
    pip_install("-e", f"{LOCAL_COPY}[tpu]")
    sys.path.insert(0, LOCAL_COPY)  # an editable install is only seen by new processes
else:
    pip_install(f"dgemma_jax[tpu] @ git+{REPO_URL}@{REPO_REF}")
importlib.invalidate_caches()
"""

DEVICES = """\
import jax

print(f"jax {jax.__version__}: backend {jax.default_backend()}, {jax.device_count()} device(s)")
HBM_BYTES = 0
for d in jax.devices():
    try:
        limit = (d.memory_stats() or {}).get("bytes_limit", 0)
    except Exception:  # not every backend reports memory
        limit = 0
    HBM_BYTES += limit
    print(f"  {d}  {d.device_kind}" + (f"  {limit / 2**30:.1f} GiB" if limit else ""))
if jax.default_backend() != "tpu":
    print("No TPU here (Runtime > Change runtime type > TPU); the cells below still run on",
          jax.default_backend(), "- slowly, so keep to the small model.")
"""

LOAD_MD = """\
## Load a model

`dgemma_jax.load_hf(path)` reads a Hugging Face DiffusionGemma directory (config.json +
safetensors, sharded index supported) into `(config, params)` without torch. Without a
checkpoint, the bundled small model (`dgemma_jax.training.load_bundled`) is used when this
version of dgemma_jax has one, else a random `tiny-2layer` model.
"""

LOAD = """\
import os
import subprocess

import jax
import numpy as np

import dgemma_jax
from dgemma_jax.engine import Engine

try:
    from dgemma_jax import SamplerConfig
except ImportError:
    from dgemma_jax.sampling.config import SamplerConfig


def resolve_checkpoint(ckpt):
    \"\"\"A local directory for CHECKPOINT (copied from gs:// or downloaded from the Hub, REPO@REVISION
    pins a revision): dgemma_jax.io.locations.resolve, the same as `dgemma generate --checkpoint`.\"\"\"
    # Private bucket: first run `from google.colab import auth; auth.authenticate_user()`.
    try:
        from dgemma_jax.io.locations import resolve
    except ImportError:  # a dgemma_jax from before checkpoint locations
        pass
    else:
        return resolve(ckpt)
    if os.path.isdir(ckpt):
        return ckpt
    local = os.path.join("/content" if os.path.isdir("/content") else os.getcwd(), "checkpoint")
    if ckpt.startswith("gs://"):
        # Private bucket: first run `from google.colab import auth; auth.authenticate_user()`.
        os.makedirs(local, exist_ok=True)
        subprocess.run(["gcloud", "storage", "cp", "-r", ckpt.rstrip("/") + "/*", local], check=True)
        return local
    from huggingface_hub import snapshot_download

    return snapshot_download(ckpt, allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"])


def load_tokenizer(path):
    \"\"\"(encode, decode) for a checkpoint directory; encode applies the chat template.\"\"\"
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)

        def encode(text):
            out = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, tokenize=True)
            out = out["input_ids"] if hasattr(out, "keys") else out
            return np.asarray(out).reshape(-1).tolist()

        return encode, lambda ids: tok.decode(list(ids), skip_special_tokens=True)
    except Exception as e:  # transformers missing or too old for this tokenizer
        print("transformers tokenizer not used:", type(e).__name__, str(e)[:200])
    path_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(path_json):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path_json)

        def encode(text):  # the Gemma 4 chat format
            return tok.encode(f"<bos><|turn>user\\n{text}<turn|>\\n<|turn>model\\n",
                              add_special_tokens=False).ids

        return encode, lambda ids: tok.decode(list(ids), skip_special_tokens=True)
    return None


def as_tokenizer(tok):
    \"\"\"Accept what a bundled model may come with: a path, (encode, decode) or an object.\"\"\"
    if tok is None:
        return None
    if isinstance(tok, (str, os.PathLike)):
        return load_tokenizer(os.fspath(tok))
    if isinstance(tok, tuple) and len(tok) == 2 and all(callable(f) for f in tok):
        return tok
    if hasattr(tok, "encode") and hasattr(tok, "decode"):
        def ids_of(text):
            out = tok.encode(text)
            return list(getattr(out, "ids", out))

        def encode(text):
            try:
                ids = ids_of(text)
            except ValueError:  # e.g. a character-level vocabulary without some of these characters
                ok = [ch for ch in text if _encodes(ch)]
                print(f"note: the tokenizer cannot encode {len(text) - len(ok)} character(s) of the prompt; "
                      "they are left out")
                ids = ids_of("".join(ok))
            bos = getattr(tok, "bos_id", None)
            return ([int(bos)] if bos is not None else []) + ids

        def _encodes(ch):
            try:
                ids_of(ch)
                return True
            except ValueError:
                return False

        return encode, lambda ids: tok.decode(list(ids))
    return None


tokenizer = None
SMALL_FALLBACK = False
if CHECKPOINT:
    path = resolve_checkpoint(CHECKPOINT)
    need = dgemma_jax.ModelConfig.from_hf(path).param_count()["total"] * 2  # bytes in bfloat16
    if HBM_BYTES and need > 0.9 * HBM_BYTES:
        print(f"warning: ~{need / 2**30:.0f} GiB of bfloat16 weights vs {HBM_BYTES / 2**30:.0f} GiB of "
              "accelerator memory here; loading will likely fail (use a bigger TPU: launch/tpu_vm.sh)")
    config, params = dgemma_jax.load_hf(path)
    tokenizer = load_tokenizer(path)
    SOURCE = f"checkpoint {CHECKPOINT}"
else:
    try:
        from dgemma_jax.training import load_bundled
    except ImportError:
        load_bundled = None
    if load_bundled is not None:
        bundled = load_bundled()
        if isinstance(bundled, dict):
            config, params, tok = bundled["config"], bundled["params"], bundled.get("tokenizer")
        elif isinstance(bundled, (tuple, list)):
            config, params, tok = bundled[0], bundled[1], (bundled[2] if len(bundled) > 2 else None)
        else:
            config, params, tok = bundled.config, bundled.params, getattr(bundled, "tokenizer", None)
        tokenizer = as_tokenizer(tok)
        SOURCE = "the bundled small model"
    else:
        names = dgemma_jax.ModelConfig.preset_names()
        tiny = "tiny-2layer" if "tiny-2layer" in names else min(
            names, key=lambda n: dgemma_jax.ModelConfig.preset(n).param_count()["total"])
        config = dgemma_jax.ModelConfig.preset(tiny)
        params = dgemma_jax.init_params(config, SEED)
        SOURCE = f"a RANDOM tiny model ({tiny}): the pipeline runs, the text is noise"
    SMALL_FALLBACK = True

if tokenizer is None:  # no tokenizer: bytes -> ids, ids shown as numbers
    def encode(text):
        return [config.bos_id] + [3 + b % (config.vocab_size - 3) for b in text.encode()][:64]

    def decode(ids):
        return " ".join(str(int(i)) for i in ids)
else:
    encode, decode = tokenizer

n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
print(f"loaded {SOURCE}: {config.num_layers} layers, {config.num_experts} experts (top {config.top_k}), "
      f"vocab {config.vocab_size}, canvas {config.canvas_length}, {n_params / 1e6:.1f} M parameters")
"""

GENERATE_MD = """\
## Generate

`Engine(config, params, SamplerConfig(...))` compiles prefill + all denoising steps + the canvas
loop into one program (`engine.generate`). The first call includes compilation; the second shows
the compiled speed. `tokens per pass` is HF's metric: generated tokens / denoiser passes.
"""

GENERATE = """\
import time

sampler = SamplerConfig(canvas_length=config.canvas_length, max_denoising_steps=STEPS,
                        eos_ids=config.eos_ids, pad_id=config.pad_id)
engine = Engine(config, params, sampler)
max_new = MAX_NEW_TOKENS
if SMALL_FALLBACK:  # a couple of canvases are enough to watch the small model
    max_new = min(MAX_NEW_TOKENS, 2 * config.canvas_length)
prompt_ids = encode(PROMPT)
prompt = np.asarray([prompt_ids], np.int32)
print(f"prompt: {len(prompt_ids)} tokens; generating up to {max_new} tokens "
      f"in canvases of {config.canvas_length}, at most {STEPS} steps each")


def visible(ids):
    \"\"\"Generated ids up to the first EOS, pads dropped.\"\"\"
    out = []
    for t in np.asarray(ids).tolist():
        if t in sampler.eos_ids:
            break
        if t != sampler.pad_id:
            out.append(t)
    return out


for attempt in ("first call, with compilation", "second call, compiled"):
    t0 = time.perf_counter()
    out = engine.generate(prompt, rng=SEED, max_new_tokens=max_new)
    tokens = np.asarray(out.tokens)[0]
    seconds = time.perf_counter() - t0
    steps = np.asarray(out.steps)[0]
    print(f"{attempt}: {seconds:.2f} s, {int(np.asarray(out.num_canvases))} canvas(es), "
          f"denoiser passes per canvas {steps[steps > 0].tolist()}, "
          f"{float(np.asarray(out.tokens_per_forward(sampler.pad_id))[0]):.1f} tokens per pass")
print()
print(decode(visible(tokens)))
"""

STEPS_MD = """\
## Watch the canvas converge

`engine.steps(...)` runs the same generation one denoising step at a time and yields a
`StepEvent(canvas_index, step, argmax [B, L], canvas [B, L], done)` after every step and a
`CanvasEvent(index, tokens, steps, finished)` per finished canvas. Every step re-samples the whole
canvas: low-entropy positions keep their sampled token, the others are re-noised, and the argmax
settles on the final text.
"""

STEPS_CELL = """\
history = {}  # canvas index -> [argmax row per step]
finished_canvases = {}
for event in engine.steps(prompt, rng=SEED, max_new_tokens=max_new):
    if hasattr(event, "argmax"):  # StepEvent
        history.setdefault(event.canvas_index, []).append(np.asarray(event.argmax)[0].copy())
    else:  # CanvasEvent
        finished_canvases[event.index] = np.asarray(event.tokens)[0]

streamed = np.concatenate([finished_canvases[i] for i in sorted(finished_canvases)])[:max_new]
streamed = np.pad(streamed, (0, max_new - streamed.size), constant_values=sampler.pad_id)
print("the step-by-step driver gives the same tokens as engine.generate:",
      bool(np.array_equal(streamed, tokens)))

for c, rows in sorted(history.items()):
    final = rows[-1]
    print(f"\\ncanvas {c}: {len(rows)} steps")
    for i, row in enumerate(rows):
        settled = float(np.mean(row == final))
        changed = int(np.sum(row != rows[i - 1])) if i else row.size
        text = decode(visible(row)).replace("\\n", " ")
        print(f"  step {i + 1:2d}  {settled:4.0%} settled  {changed:3d} changed | {text[:90]}")
"""

PLOT = """\
try:
    import matplotlib.pyplot as plt
except ImportError:
    plt = None
    print("matplotlib is not installed; skipping the plots")

if plt is not None:
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 3.8))
    for c, rows in sorted(history.items()):
        final = rows[-1]
        ax0.plot(range(1, len(rows) + 1), [np.mean(r == final) for r in rows], marker="o", label=f"canvas {c}")
    ax0.set(xlabel="denoising step", ylabel="fraction equal to the final argmax", ylim=(0, 1.05),
            title="convergence per canvas")
    ax0.legend()
    rows = history[min(history)]
    ax1.imshow(np.stack([r == rows[-1] for r in rows]), aspect="auto", cmap="Greens", interpolation="nearest")
    ax1.set(xlabel="canvas position", ylabel="step", title="canvas 0: positions already at their final token")
    plt.tight_layout()
    plt.show()
"""

NEXT_MD = """\
## Next

* Bigger models on a v5e-8 / v6e-8 / v5p-8 or a multi-host slice: `launch/tpu_vm.sh`, or GKE with
  XPK: `launch/gke_xpk.sh` (see `launch/README.md`).
* The sampler knobs (`SamplerConfig`: steps, temperatures, entropy bound, stopping thresholds) and
  the library API are described in the project README.
"""

CELLS = [
    ("markdown", INTRO),
    ("code", SETTINGS),
    ("markdown", INSTALL_MD),
    ("code", INSTALL),
    ("code", DEVICES),
    ("markdown", LOAD_MD),
    ("code", LOAD),
    ("markdown", GENERATE_MD),
    ("code", GENERATE),
    ("markdown", STEPS_MD),
    ("code", STEPS_CELL),
    ("code", PLOT),
    ("markdown", NEXT_MD),
]

METADATA = {
    "accelerator": "TPU",
    "colab": {"gpuType": "V5E1", "provenance": [], "toc_visible": True},
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def _lines(text: str) -> list[str]:
    """Source as Jupyter stores it: lines keeping their newline, the last one without."""
    return text.rstrip("\n").splitlines(keepends=True)


def build() -> dict:
    cells = []
    for i, (kind, text) in enumerate(CELLS):
        cell = {"cell_type": kind, "id": f"cell-{i:02d}", "metadata": {}, "source": _lines(text)}
        if kind == "code":
            cell["execution_count"] = None
            cell["outputs"] = []
        cells.append(cell)
    return {"cells": cells, "metadata": METADATA, "nbformat": 4, "nbformat_minor": 5}


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------- checking
def source_text(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def strip_magics(src: str) -> str:
    """Shell (`!cmd`) and magic (`%cmd`, `%%cell`) lines become `pass` at the same indentation."""
    out = []
    for line in src.splitlines():
        body = line.lstrip()
        if body.startswith(("!", "%")):
            out.append(line[: len(line) - len(body)] + "pass  # " + body)
        else:
            out.append(line)
    return "\n".join(out) + "\n"


_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def validate(nb, text: str | None = None) -> list[str]:
    """Problems with an nbformat 4 notebook (an empty list when it is fine)."""
    problems = []
    if not isinstance(nb, dict):
        return ["the notebook is not a JSON object"]
    for key in ("cells", "metadata", "nbformat", "nbformat_minor"):
        if key not in nb:
            problems.append(f"missing top-level key {key!r}")
    extra = set(nb) - {"cells", "metadata", "nbformat", "nbformat_minor"}
    if extra:
        problems.append(f"unexpected top-level keys {sorted(extra)}")
    if nb.get("nbformat") != 4:
        problems.append(f"nbformat is {nb.get('nbformat')!r}, not 4")
    minor = nb.get("nbformat_minor")
    if not isinstance(minor, int) or minor < 0:
        problems.append(f"nbformat_minor {minor!r} is not a non-negative integer")
    meta = nb.get("metadata", {})
    if not isinstance(meta, dict):
        problems.append("metadata is not an object")
    elif meta.get("kernelspec", {}).get("name") != "python3":
        problems.append("metadata.kernelspec.name is not 'python3'")
    cells = nb.get("cells", [])
    if not isinstance(cells, list) or not cells:
        return problems + ["cells is not a non-empty list"]
    seen = set()
    for i, cell in enumerate(cells):
        where = f"cell {i}"
        if not isinstance(cell, dict):
            problems.append(f"{where} is not an object")
            continue
        kind = cell.get("cell_type")
        if kind not in ("code", "markdown", "raw"):
            problems.append(f"{where}: cell_type {kind!r} is not code, markdown or raw")
        if not isinstance(cell.get("metadata"), dict):
            problems.append(f"{where}: metadata is not an object")
        src = cell.get("source")
        if not (isinstance(src, str) or (isinstance(src, list) and all(isinstance(s, str) for s in src))):
            problems.append(f"{where}: source is not a string or a list of strings")
        if isinstance(minor, int) and minor >= 5:
            cid = cell.get("id")
            if not isinstance(cid, str) or not _ID.match(cid):
                problems.append(f"{where}: id {cid!r} is not 1-64 letters, digits, '-' or '_'")
            elif cid in seen:
                problems.append(f"{where}: duplicate id {cid!r}")
            seen.add(cid)
        allowed = {"cell_type", "id", "metadata", "source", "attachments"}
        if kind == "code":
            allowed |= {"execution_count", "outputs"}
            if not isinstance(cell.get("outputs"), list):
                problems.append(f"{where}: a code cell needs an outputs list")
            if "execution_count" not in cell or not (cell["execution_count"] is None
                                                      or isinstance(cell["execution_count"], int)):
                problems.append(f"{where}: a code cell needs execution_count (null or an integer)")
            try:
                compile(strip_magics(source_text(cell)), f"<{where}>", "exec")
            except SyntaxError as e:
                problems.append(f"{where}: does not compile: {e.msg} (line {e.lineno})")
        extra = set(cell) - allowed
        if extra:
            problems.append(f"{where}: unexpected keys {sorted(extra)}")
    if text is not None and text != dumps(build()):
        problems.append("the notebook differs from what launch/make_colab.py generates; "
                        "run `python launch/make_colab.py` to regenerate it")
    return problems


def check(path: Path, show: bool = True) -> int:
    try:
        text = path.read_text()
        nb = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        print(f"{path}: cannot read the notebook: {e}", file=sys.stderr)
        return 1
    problems = validate(nb, text if path.resolve() == NOTEBOOK else None)
    if show:
        code = [c for c in nb.get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "code"]
        for i, cell in enumerate(code):
            print(f"# ---- code cell {i + 1}/{len(code)} ({cell.get('id', '?')})")
            print(source_text(cell).rstrip("\n"))
            print()
    for p in problems:
        print(f"{path}: {p}", file=sys.stderr)
    if problems:
        return 1
    cells = nb["cells"]
    n_code = sum(c["cell_type"] == "code" for c in cells)
    print(f"{path}: ok (nbformat {nb['nbformat']}.{nb['nbformat_minor']}, {len(cells)} cells, {n_code} code)")
    return 0


# ----------------------------------------------------------------------------- running
def parse_override(item: str) -> tuple[str, object]:
    if "=" not in item:
        raise argparse.ArgumentTypeError(f"--set expects NAME=VALUE; got {item!r}")
    name, value = item.split("=", 1)
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--set: {name!r} is not a Python name")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a bare string


def run(path: Path, overrides: dict) -> int:
    """Execute the code cells in one namespace; overrides are applied after the settings cell."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    nb = json.loads(path.read_text())
    ns: dict = {"__name__": "__main__"}
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code):
        src = source_text(cell)
        print(f"# ---- running code cell {i + 1}/{len(code)} ({cell.get('id')})", flush=True)
        exec(compile(strip_magics(src), f"<{cell.get('id')}>", "exec"), ns)
        if i == 0:
            unknown = sorted(set(overrides) - set(ns))
            if unknown:
                print(f"--set: {unknown} are not settings of the notebook", file=sys.stderr)
                return 2
            ns.update(overrides)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="validate the notebook and print its code cells")
    mode.add_argument("--run", action="store_true", help="execute the notebook's code cells here")
    ap.add_argument("--quiet", action="store_true", help="with --check: do not print the code cells")
    ap.add_argument("--set", dest="overrides", action="append", default=[], type=parse_override,
                    metavar="NAME=VALUE", help="with --run: override a setting (repeatable)")
    ap.add_argument("--notebook", type=Path, default=NOTEBOOK, help=f"notebook path (default {NOTEBOOK})")
    args = ap.parse_args(argv)
    if args.overrides and not args.run:
        ap.error("--set only applies with --run")
    if args.check:
        return check(args.notebook, show=not args.quiet)
    if args.run:
        return run(args.notebook, dict(args.overrides))
    args.notebook.write_text(dumps(build()))
    print(f"wrote {args.notebook}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
