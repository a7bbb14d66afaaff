#!/usr/bin/env python3
"""Write, check or run the Colab TPU notebook `launch/colab_tpu.ipynb`.

The cells are defined here (the notebook is generated, so edit this file and regenerate):

    python launch/make_colab.py                 # (re)write launch/colab_tpu.ipynb
    python launch/make_colab.py --check         # validate the notebook and print its code cells
    python launch/make_colab.py --run --set SEED=3
                                                # execute the code cells here (magics skipped)

`--check` needs no Jupyter packages: it checks the nbformat 4 structure by hand (top-level keys,
cell types, ids, sources, outputs), that every code cell compiles once `!`/`%` lines are set
aside, and that the file matches what this script generates. Exit status 1 lists the problems.
`--run` runs the code cells in one namespace, like a notebook kernel would, after applying the
`--set NAME=VALUE` overrides to the settings cell; with the default empty CHECKPOINT it runs
the bundled model on whatever JAX backend is present.
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

dgemma_jax runs DiffusionGemma, a text diffusion model with a Gemma 4 mixture-of-experts backbone,
in JAX. Instead of writing one token at a time it denoises a whole *canvas* of tokens (256 for the
released model) in parallel, over up to 48 steps, then commits it and starts the next canvas.

1. **Runtime > Change runtime type > TPU** (v5e-1, v6e-1 or v2-8). The notebook also runs on a CPU
   or GPU runtime, more slowly.
2. **Runtime > Run all.** With the settings as they are it runs the small model bundled with
   dgemma_jax (299k parameters, trained to sort digit strings: `s9350814272=` gives `0122345789`).

Which model fits: the released `diffusiongemma-26B-A4B-it` holds 25 B parameters: 50.5 GB of
weights in bfloat16, 26.1 GB in int8, 13.5 GB in int4 (counted from its shapes). `QUANTIZE = "auto"`
takes the first of bfloat16, int8 and int4 whose weights fit 90% of the chip's memory, and quantizes
each tensor as it is read (the bfloat16 model is never whole in memory). What the TPU compiler says of
one chip (compiled from a CPU machine; projections, not runs; `docs/quantization.md`, "One chip"):
- **v6e-1 (32 GB), int8:** the generate program (a 2,048-token prompt), vision tower included, takes
  28.4 GB with an 8,192-token cache; projected 17 ms a denoising step, about 920 tokens/s at 16 steps a canvas.
- **v5e-1 (16 GB), int4:** the generate program with an 8,192-token cache (a 512-token prompt), vision
  tower included (in int4), takes 14.9 GB: it fits, because the 25 sliding-window layers keep only their
  window and a canvas (rings of 1,280 slots; before those rings 8k needed 0.6 GB more than the chip has).
  Projected 19 ms a denoising step, about 830 tokens/s.
What the 26B needs of the runtime's host, against what Colab's TPU runtimes have:

| | needs | v5e-1 runtime | v6e-1 runtime |
|---|---|---|---|
| disk | 51 GB: the bfloat16 safetensors, downloaded once a session | about 225 GB | about 225 GB |
| host RAM | under 8 GB: a few copies of the largest tensor, then the compiler (never the model) | 48 GB | about 173 GB |

The needs were measured on a CPU machine: a quantizing load's peak stayed under the quantized
weights plus 6x the largest tensor (one layer's experts: 1 GB in bfloat16;
`tests/test_quant_streaming.py`; on a TPU the weights go to the chip, not to host RAM), and compiling
the 26B's programs for one chip peaked at 6.1 GB. The runtimes' figures are looked up, not
measured here: 48 GB is the Cloud TPU v5e single-chip VM's (ct5lp-hightpu-1t, Cloud TPU v5e docs),
173 GB a Colab user's report for v6e-1 (googlecolab/colabtools#5532), 225 GB of disk Colab users'
reports for TPU runtimes (googlecolab/colabtools#990). Check yours with `!free -g; df -h /`.

A v5e-8 / v6e-8 / v5p-8 holds the bfloat16 model: `launch/tpu_vm.sh` (see `launch/README.md`).
"""

SETTINGS = """\
# @title Settings { display-mode: "form" }
# A DiffusionGemma checkpoint: a local directory, a gs:// directory or a Hugging Face Hub repo id
# (google/diffusiongemma-26B-A4B-it). Empty: the small model bundled with dgemma_jax.
CHECKPOINT = ""  # @param {type:"string"}
# Empty: the bundled model's example (digits to sort), or a question for a real checkpoint.
PROMPT = ""  # @param {type:"string"}
QUANTIZE = "auto"  # @param ["auto", "none", "int8", "int4"]
# How the compiled programs lay out the layers. auto: scan on a TPU (the repeated layer group compiled
# once: each Colab session compiles anew; the 26B int8 generate on a v6e-1 compiles in 107 s instead
# of 190 s, for 1.18x the HBM traffic per step), unrolled elsewhere.
LAYERS = "auto"  # @param ["auto", "unrolled", "scan"]
# 0: the library's default (256 tokens, fewer where the model's context ends sooner).
MAX_NEW_TOKENS = 0  # @param {type:"integer"}
SEED = 0  # @param {type:"integer"}
# Where dgemma_jax comes from when it is not installed yet: a wheel or source archive uploaded to
# /content (dgemma_jax-*.whl / dgemma_jax-*.tar.gz, built with `pip wheel --no-deps -w dist .`),
# else this URL: a wheel's (https://.../dgemma_jax-0.1.0-py3-none-any.whl) or the repository's
# (git+https://github.com/OWNER/dgemma_jax). dgemma_jax is on no package index, so a bare name fails.
PACKAGE_URL = ""  # @param {type:"string"}
"""

INSTALL_MD = """\
## Install

Nothing is installed when `dgemma_jax` is already importable. Otherwise a wheel or source archive
of dgemma_jax uploaded to `/content` (the file browser on the left) is installed with the `[tpu]`
extra, which pins `jax[tpu]`; without one, `PACKAGE_URL` (a wheel's URL or `git+https://` of the
repository; dgemma_jax is on no package index). The cell checks the setting and says which it used. If Colab had
already imported another jax version, restart the session (Runtime > Restart session) after this
cell.
"""

INSTALL = """\
import glob
import importlib
import importlib.util
import os
import subprocess
import sys

UPLOAD_DIR = "/content"  # where Colab's file browser uploads go


def install_source(search_dir, url):
    \"\"\"(pip requirement, what it is): the newest uploaded wheel or source archive, else the URL, checked.\"\"\"
    found = sorted(glob.glob(os.path.join(search_dir, "dgemma_jax-*.whl"))
                   + glob.glob(os.path.join(search_dir, "dgemma_jax-*.tar.gz")), key=os.path.getmtime)
    if found:
        return f"{found[-1]}[tpu]", f"the uploaded file {os.path.basename(found[-1])}"
    url = url.strip()
    if not url:
        raise SystemExit(f"dgemma_jax is not installed: upload a wheel (dgemma_jax-*.whl, built with `pip wheel "
                         f"--no-deps -w dist .`) to {search_dir}, or set PACKAGE_URL in the settings cell to a "
                         "wheel's URL or git+https://... of the repository, and run this cell again")
    if url.startswith("git+"):
        return f"dgemma_jax[tpu] @ {url}", f"the repository {url}"
    if url.startswith(("https://", "http://")) and url.split("?")[0].endswith((".whl", ".tar.gz", ".zip")):
        return f"dgemma_jax[tpu] @ {url}", f"the archive {url}"
    raise SystemExit(f"PACKAGE_URL={url!r} is neither a wheel or archive URL (https://.../dgemma_jax-*.whl) nor a "
                     "repository (git+https://...): dgemma_jax is on no package index, so pip cannot find it by name")


if importlib.util.find_spec("dgemma_jax") is not None:
    print("dgemma_jax is already installed; nothing to install")
else:
    requirement, what = install_source(UPLOAD_DIR, PACKAGE_URL)
    print("installing dgemma_jax from", what)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", requirement], check=True)
    except subprocess.CalledProcessError:
        raise SystemExit(f"pip could not install {requirement!r}. Build a wheel from a dgemma_jax checkout "
                         f"with `pip wheel --no-deps -w dist .`, upload dist/dgemma_jax-*.whl to {UPLOAD_DIR} "
                         "and run this cell again (or set PACKAGE_URL to a wheel or repository pip can reach)") from None
importlib.invalidate_caches()
"""

DEVICES = """\
import jax

print(f"jax {jax.__version__}: backend {jax.default_backend()}, {jax.device_count()} device(s)")
for d in jax.devices():
    try:
        limit = (d.memory_stats() or {}).get("bytes_limit", 0)
    except Exception:  # not every backend reports memory
        limit = 0
    print(f"  {d}  {d.device_kind}" + (f"  {limit / 2**30:.1f} GiB" if limit else ""))
if jax.default_backend() != "tpu":
    print("No TPU here (Runtime > Change runtime type > TPU); the cells below still run on",
          jax.default_backend(), "- slowly, so keep to the small model.")
"""

HUB_MD = """\
## Hugging Face Hub login (gated checkpoints)

The released checkpoint is gated: accept its license on its Hub page with your account, then give
this session a token with read access: a Colab secret named `HF_TOKEN` (the key icon on the left,
with notebook access on), or `from huggingface_hub import notebook_login; notebook_login()`. The cell
below checks for a token when `CHECKPOINT` is a Hub repo id and does nothing otherwise.
"""

HUB_LOGIN = """\
import os  # noqa: F811 (this cell runs on its own too)


def is_hub_repo(checkpoint):
    \"\"\"A Hub repo id (owner/name[@revision]), not a local or gs:// path.\"\"\"
    return (bool(checkpoint) and "://" not in checkpoint and not checkpoint.startswith(("/", ".", "~"))
            and not os.path.exists(checkpoint) and checkpoint.split("@")[0].count("/") == 1)


if is_hub_repo(CHECKPOINT):
    from huggingface_hub import get_token

    token = os.environ.get("HF_TOKEN") or get_token()
    if not token:
        try:  # a Colab secret named HF_TOKEN
            from google.colab import userdata

            token = userdata.get("HF_TOKEN")
        except Exception:  # not in Colab, or no such secret / no notebook access
            token = None
    if not token:
        raise SystemExit(f"{CHECKPOINT} is on the Hugging Face Hub and may be gated: accept its license on its Hub "
                         "page, then add a Colab secret HF_TOKEN (a read token) or run `from huggingface_hub import "
                         "notebook_login; notebook_login()`, and run this cell again")
    os.environ["HF_TOKEN"] = token
    print(f"a Hugging Face token is set for {CHECKPOINT}")
else:
    print("no Hub login needed" + (f" for {CHECKPOINT}" if CHECKPOINT else " (the bundled model)"))
"""

LOAD_MD = """\
## Load a model

`dgemma_jax.DiffusionGemma.from_pretrained(checkpoint)` reads a Hugging Face DiffusionGemma
checkpoint (config.json + safetensors, no torch) or one in dgemma_jax's format, with its tokenizer
and chat template; `None` loads the bundled small model. With several chips the weights are split
over all of them (experts over an `expert` mesh axis); on one chip they must fit that chip.
"""

LOAD = """\
import numpy as np

import dgemma_jax
from dgemma_jax.io.locations import resolve
from dgemma_jax.model.quant import resolve_quantize, weight_bytes
from dgemma_jax.parallel import Shardings, make_mesh

if LAYERS == "auto":  # the library's choice for a notebook: scan on a TPU, unrolled elsewhere
    LAYERS = dgemma_jax.runtime.resolve_layers("auto", jax.default_backend(), entry="notebook")
runtime = dgemma_jax.Runtime(layers=LAYERS)
BUNDLED = not CHECKPOINT
if BUNDLED:
    model = dgemma_jax.DiffusionGemma.from_pretrained(None, runtime=runtime)
    SOURCE = "the bundled small model"
else:
    path = resolve(CHECKPOINT)  # a gs:// directory is copied, a Hub repo id downloaded
    config = dgemma_jax.ModelConfig.from_hf(path)
    shardings = None
    if jax.device_count() > 1:  # the weights split over every chip, experts on an `expert` axis
        shardings = Shardings(config, make_mesh(f"expert={jax.device_count()}"), "latency")
    # auto: the first of none / int8 / int4 whose weights fit 90% of the chips the weights go to
    devices = shardings.mesh.devices.flat if shardings is not None else jax.devices()[:1]
    quantize = resolve_quantize(config, QUANTIZE, devices)
    print(f"QUANTIZE={QUANTIZE}: {quantize or config.param_dtype} weights, "
          f"{weight_bytes(config, quantize) / 2**30:.1f} GiB")
    # a bar per tensor read (and quantized); the Hub download above shows huggingface_hub's bars
    model = dgemma_jax.DiffusionGemma.from_pretrained(path, shardings=shardings, quantize=quantize, runtime=runtime,
                                                      progress=True)
    SOURCE = f"checkpoint {CHECKPOINT}" + (f" ({quantize})" if quantize else "")
if not PROMPT:
    PROMPT = "s9350814272=" if BUNDLED else "Explain in two sentences how a diffusion language model writes text."

config = model.config
n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(model.params))
print(f"loaded {SOURCE}: {config.num_layers} layers ({LAYERS}), {config.num_experts} experts (top {config.top_k}), "
      f"vocab {config.vocab_size}, canvas {config.canvas_length}, {n_params / 1e6:.1f} M parameters")
"""

GENERATE_MD = """\
## Generate

`model.generate(text)` (the bundled model: a raw prompt) or `model.chat(messages)` (a real
checkpoint: its chat template) runs prefill, every denoising step and the canvas loop as one
compiled program. The first call includes compilation (a bar counts the programs as they are
compiled: minutes for the 26B, each Colab session anew); the second shows the compiled speed.
"""

GENERATE = """\
import time

from dgemma_jax.progress import compiling


max_new = MAX_NEW_TOKENS or None  # None: the library's default


def answer():
    if BUNDLED:
        return model.generate(PROMPT, max_new_tokens=max_new, seed=SEED)
    return model.chat([{"role": "user", "content": PROMPT}], max_new_tokens=max_new, seed=SEED)


t0 = time.perf_counter()
with compiling():  # a bar: counts and names the programs as jax compiles them
    ANSWER = answer()
print(f"first call, with compilation: {time.perf_counter() - t0:.2f} s")
t0 = time.perf_counter()
ANSWER = answer()
print(f"second call, compiled: {time.perf_counter() - t0:.2f} s")
print(f"prompt: {PROMPT!r}")
print(f"answer: {ANSWER!r}")
"""

STEPS_MD = """\
## Watch the canvas converge

`model.engine.steps(...)` runs the same generation one denoising step at a time and yields a
`StepEvent(canvas_index, step, argmax [B, L], canvas [B, L], done)` after every step and a
`CanvasEvent(index, tokens, steps, finished)` per finished canvas. Every step re-samples the whole
canvas: low-entropy positions keep their sampled token, the others are re-noised, and the argmax
settles on the final text.
"""

STEPS_CELL = """\
from dgemma_jax.engine.inputs import default_new_tokens
from dgemma_jax.io.chat import render_chat

if BUNDLED:
    prompt, lengths = model.encode_batch([PROMPT])
else:
    text = render_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = np.asarray([model.tokenizer.encode(text)], np.int32)
    lengths = None
tok = model.tokenizer
pad = model.sampler.pad_id
if max_new is None:  # the library's default for this prompt, as model.generate / model.chat use
    max_new = default_new_tokens(config, model.sampler, int(prompt.shape[1]))

history = {}  # canvas index -> [argmax row per step]
canvases = {}
for event in model.engine.steps(prompt, lengths, rng=SEED, max_new_tokens=max_new):
    if hasattr(event, "argmax"):  # StepEvent
        history.setdefault(event.canvas_index, []).append(np.asarray(event.argmax)[0].copy())
    else:  # CanvasEvent
        canvases[event.index] = np.asarray(event.tokens)[0]

streamed = [int(t) for i in sorted(canvases) for t in canvases[i] if int(t) != pad]
if BUNDLED:
    print("the step-by-step driver gives the same answer as model.generate:",
          tok.decode_generated(streamed, skip_special=True) == ANSWER)

for c, rows in sorted(history.items()):
    final = rows[-1]
    print(f"\\ncanvas {c}: {len(rows)} steps")
    for i, row in enumerate(rows):
        settled = float(np.mean(row == final))
        changed = int(np.sum(row != rows[i - 1])) if i else row.size
        text = tok.decode_generated(row, skip_special=True).replace("\\n", " ")
        print(f"  step {i + 1:2d}  {settled:4.0%} settled  {changed:3d} changed | {text[:90]}")
"""

PLOT = """\
import matplotlib.pyplot as plt

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 3.8))
for c, rows in sorted(history.items()):
    final = rows[-1]
    ax0.plot(range(1, len(rows) + 1), [np.mean(r == final) for r in rows], marker="o", label=f"canvas {c}")
ax0.set(xlabel="denoising step", ylabel="fraction equal to the final argmax", ylim=(0, 1.05),
        title="convergence per canvas")
ax0.legend()
rows = history[min(history)]
# vmin/vmax fixed: a canvas settled from its first step is all dark green, not scaled to one pale colour
ax1.imshow(np.stack([r == rows[-1] for r in rows]).astype(float), aspect="auto", cmap="Greens", vmin=0, vmax=1,
           interpolation="nearest")
ax1.set(xlabel="canvas position", ylabel="step", title="canvas 0: positions already at their final token")
plt.tight_layout()
plt.show()
"""

NEXT_MD = """\
## Next

* Bigger models on a v5e-8 / v6e-8 / v5p-8 or a multi-host slice: `launch/tpu_vm.sh`, or GKE with
  XPK: `launch/gke_xpk.sh` (see `launch/README.md`).
* The sampler knobs (`SamplerConfig`: steps, temperatures, entropy bound, stopping thresholds) and
  the library API: the project README and `docs/api.md`.
"""

CELLS = [
    ("markdown", INTRO),
    ("code", SETTINGS),
    ("markdown", INSTALL_MD),
    ("code", INSTALL),
    ("code", DEVICES),
    ("markdown", HUB_MD),
    ("code", HUB_LOGIN),
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
