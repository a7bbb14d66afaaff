"""`dgemma` commands that run a model: generate, chat, convert, train, bench."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile
import time

import jax
import numpy as np

from dgemma_jax import compile_cache
from dgemma_jax.compile_cache import CompileCounter
from dgemma_jax.axis_rules import RULE_SETS
from dgemma_jax.chat_session import ChatSession
from dgemma_jax.engine import Engine
from dgemma_jax.engine.drivers import CanvasEvent, collect
from dgemma_jax.engine.grammar import compile_grammar
from dgemma_jax.engine.inputs import DEFAULT_NEW_TOKENS, default_new_tokens
from dgemma_jax.engine.outputs import warn_if_cut_short
from dgemma_jax.errors import UsageError
from dgemma_jax.io import convert
from dgemma_jax.io.bundled import BUNDLED, DEFAULT_NAME, VISION_NAME, bundled_choice
from dgemma_jax.io.locations import resolve
from dgemma_jax.model.quant import QUANTIZE_CHOICES
from dgemma_jax.parallel.distributed import is_main_process, main_print, read_on_main_process
from dgemma_jax.parallel.mesh import make_mesh
from dgemma_jax.parallel.profiling import profile
from dgemma_jax.parallel.shardings import Shardings, fetch
from dgemma_jax.io.images import SOFT_TOKEN_BUDGETS, load_image, prompt_with_images
from dgemma_jax.pipeline import load_checkpoint as load_for_cli
from dgemma_jax.progress import StartReport
from dgemma_jax.runtime import LAYER_LAYOUTS, Runtime, resolve_layers
from dgemma_jax.sampling import settings as sampler_settings
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import SEED_RANGE
from dgemma_jax.training import adapters as adapters_lib


def sampler_from_args(args, config, base):
    s = base or SamplerConfig.for_model(config)
    changes = sampler_settings.changes_from_args(args)
    return s.replace(**changes) if changes else s


def _seed_canvas(args, tok, sampler, batch_size: int):
    """--seed-canvas TEXT: characters/tokens held fixed; --mask-char marks the free positions."""
    if not args.seed_canvas:
        return None, None
    mask = args.mask_char
    parts = args.seed_canvas
    ids, pinned = [], []
    buf = ""
    for ch in parts + "\0":
        if ch == mask or ch == "\0":
            if buf:
                piece = list(tok.encode(buf))
                ids += piece
                pinned += [True] * len(piece)
                buf = ""
            if ch == mask:
                ids.append(0)
                pinned.append(False)
        else:
            buf += ch
    if len(ids) > sampler.canvas_length:
        raise UsageError(f"--seed-canvas has {len(ids)} tokens but the canvas holds {sampler.canvas_length}; "
                         "shorten it or raise --canvas-length")
    free = sampler.canvas_length - len(ids)
    ids += [0] * free
    pinned += [False] * free
    return (np.array([ids] * batch_size, np.int32), np.array([pinned] * batch_size, bool))


def mesh_flags(s, rules: str = "latency") -> None:
    """--mesh and --rules, the same for every command that runs the model."""
    s.add_argument("--mesh", default=None,
                   help="shard the model over the devices of every host of the run, e.g. expert=8 or tensor=4,expert=2 "
                        "(axes data, fsdp, tensor, expert; default: one device)")
    s.add_argument("--rules", default=rules,
                   help=f"how logical axes map to mesh axes: {', '.join(RULE_SETS)} or a rules file (default {rules}; "
                        "docs/tpu.md)")
    s.add_argument("--layers", choices=LAYER_LAYOUTS, default="auto",
                   help="how the compiled programs lay out the layers: unrolled, or scan (the repeated layer group "
                        "compiled once: on TPU about half the compile time, 1.02-1.25x the HBM traffic per call); "
                        "auto (default): on TPU scan for generate and chat, unrolled for serve; unrolled elsewhere "
                        "(docs/tpu.md)")


def runtime_for(args, platform: str | None = None) -> Runtime:
    """The Runtime of a command's engine: --layers, "auto" resolved for this command on `platform`
    (default: this process's backend) by `runtime.resolve_layers`."""
    platform = platform or jax.default_backend()
    return Runtime(layers=resolve_layers(getattr(args, "layers", "auto"), platform, entry=args.command))


def load_model_for_cli(args, checkpoint=None):
    """(config, params, sampler, tokenizer, shardings) for --checkpoint, read straight into the --mesh's
    shards and quantized by --quantize as each tensor is read (`pipeline.load_checkpoint`)."""
    mesh = make_mesh(args.mesh) if getattr(args, "mesh", None) else None
    rules = getattr(args, "rules", "latency")
    checkpoint = args.checkpoint if checkpoint is None else checkpoint
    is_bundled, name = bundled_choice(checkpoint)
    what = (f"the bundled model {name or DEFAULT_NAME}" if is_bundled else checkpoint) + \
        (f" into {args.quantize}" if getattr(args, "quantize", None) not in (None, "none") else "")
    with start_report(args).loading(what) as wrap:
        cfg, params, sampler, tok = load_for_cli(checkpoint, args.dtype, args.revision, mesh=mesh, rules=rules,
                                                 mirror=getattr(args, "mirror", None),
                                                 quantize=getattr(args, "quantize", None), progress=wrap)
    shardings = Shardings(cfg, mesh, rules) if mesh is not None else None
    return cfg, params, sampler, tok, shardings


def start_report(args) -> StartReport:
    """Load and compile progress on stderr (bars on a terminal, a few lines otherwise); off with --quiet and
    on every host but the first. One per command run (kept on `args`)."""
    if getattr(args, "start_report", None) is None:
        args.start_report = StartReport(sys.stderr, enabled=not getattr(args, "quiet", False) and is_main_process())
    return args.start_report


def check_lora_path(args) -> None:
    """Refuse a --lora path that holds no adapter checkpoint before the model loads (one error line,
    not minutes of loading first)."""
    if getattr(args, "lora", None):
        try:
            adapters_lib.locate(args.lora)
        except ValueError as e:
            raise UsageError(f"--lora {args.lora}: {e}") from None


def lora_for(args, config):
    """The --lora adapter laid out for the engine (`training.adapters.single`), or None."""
    if not getattr(args, "lora", None):
        return None
    try:
        return adapters_lib.single(config, adapters_lib.load_adapter(args.lora, config))
    except ValueError as e:
        raise UsageError(f"--lora {args.lora}: {e}") from None


def lora_flag(s) -> None:
    s.add_argument("--lora", metavar="PATH", default=None,
                   help="a LoRA adapter run unmerged beside the checkpoint: a `dgemma train` LoRA run's work "
                        "directory (its latest checkpoint) or one of its checkpoints/<step> directories")


# ---------------------------------------------------------------------------- generate
def _strip_final_newline(text: str) -> str:
    """A piped prompt (`echo PROMPT | dgemma generate`) without the one newline the shell adds."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


def _seed(s: str) -> int:
    """--seed: any 64-bit integer, signed or unsigned."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if not SEED_RANGE[0] <= v < SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{s} does not fit in 64 bits; use an integer in [-2**63, 2**64)")
    return v


def _render_step(ev, tok, tty: bool, stream):
    arg = ev.argmax[0]
    settled = ev.canvas[0] == arg
    if not tty:
        frac = settled.mean()
        text = tok.decode_generated(arg, skip_special=True)
        stream.write(f"[canvas {ev.canvas_index} step {ev.step:>2} settled {frac:4.0%}] {text!r}\n")
        return
    out = []
    for t, ok in zip(arg, settled):
        s = tok.decode_generated([t], skip_special=True).replace("\n", "\\n")
        out.append(f"\x1b[1m{s}\x1b[0m" if ok else f"\x1b[2m{s}\x1b[0m")
    stream.write(f"\r\x1b[2K[{ev.canvas_index}:{ev.step:>2}] " + "".join(out))
    stream.flush()


def _step_printer(tok, plain: bool, stream):
    """--show-steps: a callback drawing each `StepEvent` on `stream` (live, in colour, on a terminal
    unless `plain`; else one line per step) and ending a canvas's line at its `CanvasEvent`."""
    tty = stream.isatty() and not plain

    def show(ev):
        if not isinstance(ev, CanvasEvent):
            _render_step(ev, tok, tty, stream)
        elif tty:
            stream.write("\n")
    return show


def cmd_generate(args) -> int:
    compiles = CompileCounter()
    prompt = args.prompt if args.prompt is not None else _strip_final_newline(read_on_main_process(sys.stdin.read))
    if not prompt:
        raise UsageError("empty prompt: pass --prompt TEXT or pipe text on stdin")
    _check_infill_flags(args)
    grammar_args = _structured_flags(args)
    check_lora_path(args)
    checkpoint = args.checkpoint
    if args.image and checkpoint in (None, ""):  # the default model for a picture: the bundled one that reads them
        checkpoint = f"{BUNDLED}:{VISION_NAME}"
        print(f"[no --checkpoint: the bundled image model {VISION_NAME}]", file=sys.stderr, flush=True)
    cfg, params, sampler, tok, shardings = load_model_for_cli(args, checkpoint)
    use_compiled(args, cfg, shardings)
    sampler = sampler_from_args(args, cfg, sampler)
    images = None
    if args.image:
        try:
            tokens, _, images = prompt_with_images(cfg, tok, prompt, args.image, args.max_soft_tokens)
        except ValueError as e:
            raise UsageError(f"--image: {e}") from None
        ids = tokens[0].tolist()
    else:
        ids = tok.encode(prompt, add_bos=True)
        tokens = np.array([ids], np.int32)
    if args.max_prompt and len(ids) > args.max_prompt:
        raise UsageError(f"the prompt is {len(ids)} tokens, longer than --max-prompt {args.max_prompt}")
    engine = Engine(cfg, params, sampler, shardings=shardings, runtime=runtime_for(args),
                    adapters=lora_for(args, cfg))
    if args.suffix is not None:
        return _generate_infill(args, engine, tok, tokens, compiles)
    if grammar_args is not None:
        return _generate_structured(args, engine, tok, tokens, grammar_args, compiles)
    seed, pinned = _seed_canvas(args, tok, sampler, 1)
    max_new = default_new_tokens(cfg, sampler, len(ids)) if args.max_new_tokens is None else args.max_new_tokens
    kw = dict(rng=args.seed, max_new_tokens=max_new, seed_canvas=seed, pinned=pinned, images=images)
    t0 = time.perf_counter()
    with profile(args.profile), start_report(args).compiling():  # --profile DIR: a jax.profiler trace
        if args.show_steps:
            show, events = _step_printer(tok, args.plain, sys.stdout), []
            for ev in engine.steps(tokens, None, **kw):
                show(ev)
                if isinstance(ev, CanvasEvent):
                    events.append(ev)
            out_tokens, steps, finished = collect(events, 1, max_new, sampler.canvas_length, sampler.pad_id)
        else:
            out = engine.generate(tokens, None, **kw)
            out_tokens, steps, finished = fetch(out.tokens), fetch(out.steps), fetch(out.finished)
        jax.block_until_ready(out_tokens)
    dt = time.perf_counter() - t0
    text = tok.decode_generated(out_tokens[0], skip_special=True)
    main_print(text)  # every host of a multi-host run computes it; the first one prints it
    if args.max_new_tokens is None:
        warn_if_cut_short(cfg, max_new, finished, len(ids))
    ran = steps[0][steps[0] > 0]
    n_tok = int((out_tokens[0] != sampler.pad_id).sum())
    if not args.quiet and is_main_process():
        tpf = n_tok / max(int(ran.sum()), 1)
        print(f"[{len(ran)} canvas(es), steps per canvas {ran.tolist()}, tokens per forward pass {tpf:.2f}, "
              f"{n_tok} tokens in {dt:.2f} s = {n_tok / dt:.1f} tokens/s incl. compilation; {compiles.summary()}]",
              file=sys.stderr)
    return 0


def _check_infill_flags(args) -> None:
    if args.suffix is None:
        return
    for flag, given in (("--seed-canvas", args.seed_canvas), ("--show-steps", args.show_steps),
                        ("--image", args.image), ("--profile", args.profile)):
        if given:
            raise UsageError(f"--suffix cannot be combined with {flag}: infill pins its own canvas")
    if not args.suffix:
        raise UsageError("--suffix is empty: give the text that follows the answer, or leave --suffix out")


def _structured_flags(args):
    """--json-schema FILE / --regex: the `compile_grammar` keywords (None without either)."""
    if args.json_schema is None and args.regex is None:
        return None
    if args.json_schema is not None and args.regex is not None:
        raise UsageError("give --json-schema or --regex, not both")
    for flag, given in (("--suffix", args.suffix is not None), ("--seed-canvas", args.seed_canvas),
                        ("--show-steps", args.show_steps), ("--image", args.image), ("--profile", args.profile)):
        if given:
            raise UsageError(f"{'--regex' if args.regex is not None else '--json-schema'} cannot be combined with "
                             f"{flag}")
    if args.regex is not None:
        return {"regex": args.regex}
    try:
        with open(args.json_schema) as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"--json-schema: cannot read {args.json_schema!r}: {e.strerror or e}") from None
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as e:
        raise UsageError(f"--json-schema: {args.json_schema!r} is not valid JSON: {e}") from None


def _generate_structured(args, engine, tok, tokens, grammar_args, compiles) -> int:
    """--json-schema / --regex: print an answer valid under the grammar (`Engine.generate_structured`)."""
    flag = "--regex" if "regex" in grammar_args else "--json-schema"
    try:
        grammar = compile_grammar(tok, engine.config.vocab_size, engine.sampler.eos_ids, **grammar_args)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    cfg, sampler = engine.config, engine.sampler
    max_new = default_new_tokens(cfg, sampler, tokens.shape[1]) if args.max_new_tokens is None else args.max_new_tokens
    t0 = time.perf_counter()
    out = engine.generate_structured(tokens, None, grammars=grammar, rng=args.seed, max_new_tokens=max_new)
    dt = time.perf_counter() - t0
    main_print(tok.decode(out.tokens[0], skip_special=True))
    if out.finish_reasons[0] == "length":
        print(f"dgemma: warning: the answer reached --max-new-tokens {max_new} before the {grammar.kind} was "
              "complete: it is a valid prefix only; raise --max-new-tokens", file=sys.stderr)
    if not args.quiet and is_main_process():
        ran = out.steps[0][out.steps[0] > 0]
        print(f"[structured ({grammar.kind}): finish_reason {out.finish_reasons[0]}, {len(ran)} canvas(es), steps "
              f"per canvas {ran.tolist()}, {int(out.repairs[0])} positions repaired, {len(out.tokens[0])} tokens in "
              f"{dt:.2f} s incl. compilation; {compiles.summary()}]", file=sys.stderr)
    return 0


def _generate_infill(args, engine, tok, tokens, compiles) -> int:
    """--suffix: print the middle between the prompt and the suffix (`Engine.infill`)."""
    suffix_ids = tok.encode(args.suffix)
    if not suffix_ids:
        raise UsageError(f"--suffix {args.suffix!r} has no tokens")
    max_new = engine.sampler.canvas_length if args.max_new_tokens is None else args.max_new_tokens
    t0 = time.perf_counter()
    try:
        with start_report(args).compiling():
            out = engine.infill(tokens, None, suffixes=[suffix_ids], rng=args.seed, max_new_tokens=max_new)
    except ValueError as e:
        raise UsageError(f"--suffix: {e}") from None
    dt = time.perf_counter() - t0
    main_print(tok.decode(out.middles[0], skip_special=True))
    if not args.quiet and is_main_process():
        print(f"[infill: {len(out.candidates[0])} middle lengths tried (0..{max_new}), chose {int(out.lengths[0])}, "
              f"{len(out.middles[0])} tokens, {int(out.steps[0])} steps, {dt:.2f} s incl. compilation; "
              f"{compiles.summary()}]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- chat
def cmd_chat(args) -> int:
    compiles = CompileCounter()
    check_lora_path(args)
    cfg, params, sampler, tok, shardings = load_model_for_cli(args)
    sampler = sampler_from_args(args, cfg, sampler)
    engine = Engine(cfg, params, sampler, shardings=shardings, runtime=runtime_for(args),
                    adapters=lora_for(args, cfg))
    session = ChatSession(engine, tok, system=args.system, thinking=args.thinking,
                          context=args.context, max_new_tokens=args.max_new_tokens, seed=args.seed,
                          max_soft_tokens=args.max_soft_tokens)
    interactive = sys.stdin.isatty()
    on_step = None
    if args.show_steps:  # on stderr, so that stdout keeps one answer line per turn (a piped chat's transcript);
        # every host runs the step driver (the same programs), the first one draws
        on_step = _step_printer(tok, args.plain, sys.stderr) if is_main_process() else (lambda ev: None)
    pending = []  # images from `/image PATH` lines, sent with the next message
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = read_on_main_process(sys.stdin.readline)  # a multi-host run: host 0's stdin, on every host
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        if line.startswith("/image"):
            path = line[len("/image"):].strip()
            try:
                load_image(path)  # refuse an unreadable file now, not after the next message
            except ValueError as e:
                print(f"dgemma: error: /image: {e}", file=sys.stderr, flush=True)
                continue
            pending.append(path)
            print(f"[image {path} goes with your next message]", file=sys.stderr, flush=True)
            continue
        try:
            with start_report(args).compiling():
                turn = session.send(line, images=pending, on_step=on_step)
        except ValueError as e:  # e.g. an image for a text-only checkpoint: the turn is dropped, the chat goes on
            print(f"dgemma: error: {e}", file=sys.stderr, flush=True)
            pending = []
            continue
        pending = []
        main_print(("model> " if interactive else "") + turn.answer, flush=True)
        if not args.quiet and is_main_process():
            first = f"; {compiles.summary()}" if session.turns == 1 else ""
            print(f"[turn {session.turns}: reused {turn.reused} cached tokens, prefilled {turn.prefilled}, "
                  f"steps {turn.steps}{first}]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- convert
def cmd_convert(args) -> int:
    src = resolve(args.src, args.revision, check=False)
    src_fmt = args.from_format or convert.detect_source(src)
    n = convert.convert(src, args.dst, src_fmt, dtype=args.dtype, preset=args.preset, progress=not args.quiet,
                        overwrite=args.force, quantize=args.quantize)
    what = f"an {args.quantize} " if args.quantize else "a "
    print(f"converted {n} tensors from {src_fmt} at {args.src} to {what}dgemma_jax checkpoint at {args.dst}")
    return 0


# ---------------------------------------------------------------------------- train / bench
def cmd_train(args) -> int:
    # deferred: the trainer (optax, orbax: ~0.5 s to import) loads only for `dgemma train`
    from dgemma_jax.training import load_config, main

    if not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config!r} does not exist (see configs/)")
    overrides = {}
    for item in args.set or []:
        key, eq, val = item.partition("=")
        if not key or not eq:
            raise UsageError(f"--set expects key=value (e.g. train.num_steps=100), got {item!r}")
        try:
            overrides[key] = json.loads(val)
        except json.JSONDecodeError:
            overrides[key] = val
    try:
        config = load_config(args.config, overrides)
    except (KeyError, AttributeError, TypeError) as e:  # TypeError: a value of another type than the recipe's
        raise UsageError(f"bad --config/--set: {e}") from None
    with profile(args.profile):  # --profile DIR: a jax.profiler trace of the whole run
        main(config)
    return 0


def cmd_bench(args) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(here, "benchmarks", "bench_cpu.py")
    if not os.path.isfile(script):
        raise UsageError("benchmarks/bench_cpu.py is not available in this installation (run from a source checkout)")
    rest = list(args.rest or [])
    if rest[:1] == ["--"]:  # `dgemma bench -- --quick`, the older spelling
        rest = rest[1:]
    asks_help = any(a in ("-h", "--help") for a in rest)
    chose_out = any(a == "--out" or a.startswith("--out=") or a == "--render" or a.startswith("--render=")
                    for a in rest)
    if not asks_help and not chose_out:  # never over the committed benchmarks/results
        out = bench_scratch_path()
        os.makedirs(os.path.dirname(out), exist_ok=True)
        rest += ["--out", out]
        print(f"dgemma bench: writing {out} and its .md (pass --out PATH to choose)", file=sys.stderr, flush=True)
    sys.argv = [script] + rest  # parsed by the benchmark's own parser (its --help lists its options)
    runpy.run_path(script, run_name="__main__")
    return 0


def bench_scratch_path() -> str:
    """Where `dgemma bench` writes unless given --out: a scratch directory, not benchmarks/results."""
    return os.path.join(tempfile.gettempdir(), "dgemma_bench", "bench_cpu.json")


# ---------------------------------------------------------------------------- parser
CHECKPOINT_HELP = ("a checkpoint (Hugging Face or dgemma_jax format): a local directory, a gs:// (or other fsspec) "
                   "URL, a Hugging Face Hub repo id, optionally REPO@REVISION, or bundled:NAME (default: the bundled "
                   "model)")


def compiled_flag(s):
    s.add_argument("--compiled", metavar="DIR",
                   help="read compiled programs from DIR and keep new ones there (made by `dgemma compile --save DIR` "
                        "or an earlier run with --compiled DIR); a DIR made for another model, devices, mesh, rules, "
                        "quantization or jax/libtpu version is refused, naming what differs")


def use_compiled(args, config, shardings=None) -> None:
    """--compiled DIR: check DIR was made for this run (`compile_cache.use_compiled_dir`) and compile into it."""
    if not getattr(args, "compiled", None):
        return
    devices = list(shardings.mesh.devices.flat) if shardings is not None else jax.devices()[:1]
    ident = compile_cache.identity(config, devices, mesh=dict(shardings.mesh.shape) if shardings is not None else None,
                                   rules=getattr(args, "rules", None), quantize=getattr(args, "quantize", None),
                                   layers=runtime_for(args).layers)
    compile_cache.use_compiled_dir(args.compiled, ident)


PROFILE_HELP = ("write a jax.profiler trace of the {what} to DIR (local or gs://; process 0 of a pod): "
                "tensorboard --logdir DIR, with tensorboard-plugin-profile")


def checkpoint_flags(s, weights: bool = True):
    """--checkpoint and --revision, the same for every command that loads a model (and --mirror where its
    weights are read: weights=True)."""
    s.add_argument("--checkpoint", help=CHECKPOINT_HELP)
    s.add_argument("--revision", default=None,
                   help="the Hub revision of --checkpoint: a branch, tag or commit (default: main)")
    if weights:
        s.add_argument("--mirror", action=argparse.BooleanOptionalAction, default=None,
                       help="copy --checkpoint's weights locally (gs://: into the local mirror; a Hub repo: into the "
                            "Hugging Face cache) and read them from there, so that later starts skip the store. "
                            "--no-mirror: each process reads only its shards' bytes straight from the store or the "
                            "Hub. Default: --no-mirror, except that a Hub repo loaded by one process is downloaded")


def add_commands(sub, positive):
    def sampler_flags(s):
        sampler_settings.add_flags(s)   # one flag per setting with a `flag` (sampling/settings.py)
        s.add_argument("--seed", type=_seed, default=0, help="any 64-bit integer (default 0)")
        s.add_argument("--max-new-tokens", type=positive(int), dest="max_new_tokens",
                       help=f"default: {DEFAULT_NEW_TOKENS}, or as many whole canvases as fit the model's positions")
        checkpoint_flags(s)
        s.add_argument("--dtype", choices=["float32", "bfloat16"],
                       help="parameter dtype (default: the checkpoint's)")
        s.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                       help="weight-only int8 (per channel) or int4 (group-wise) expert, attention and MLP kernels, "
                            "quantized on load; auto: the first of none/int8/int4 whose weights fit the devices' "
                            "memory (none on CPU); default none")

    s = sub.add_parser("generate", help="prompt -> text")
    s.add_argument("--prompt", help="the prompt (default: read stdin)")
    s.add_argument("--show-steps", action="store_true", help="draw the canvas converging step by step")
    s.add_argument("--plain", action="store_true", help="with --show-steps: one line per step, no colours")
    s.add_argument("--seed-canvas", dest="seed_canvas", help="start canvas text; --mask-char marks free positions")
    s.add_argument("--mask-char", dest="mask_char", default="_",
                   help="the character of --seed-canvas that marks a free position (default _)")
    s.add_argument("--suffix", default=None, metavar="TEXT",
                   help="infill: print the middle between the prompt and TEXT (the suffix is pinned on the canvas; "
                        "--max-new-tokens bounds the middle, default one canvas)")
    s.add_argument("--json-schema", dest="json_schema", default=None, metavar="FILE",
                   help="structured output: the answer is JSON valid under the JSON schema in FILE")
    s.add_argument("--regex", default=None, metavar="REGEX", help="structured output: the answer matches REGEX")
    s.add_argument("--max-prompt", type=positive(int), dest="max_prompt", default=None,
                   help="refuse prompts longer than this many tokens (default: no limit but the model's positions)")
    s.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the prompt (repeatable; a checkpoint with a vision tower): each goes at a "
                        "<|image|> marker of the prompt, or before the prompt when it has none; without --checkpoint, "
                        f"the bundled image model {VISION_NAME}")
    s.add_argument("--max-soft-tokens", type=int, choices=SOFT_TOKEN_BUDGETS, dest="max_soft_tokens", default=None,
                   help="tokens per image (default: the checkpoint's, 280 for the released model)")
    s.add_argument("--quiet", action="store_true", help="no load / compile progress and no stats line")
    lora_flag(s)
    compiled_flag(s)
    mesh_flags(s)
    s.add_argument("--profile", metavar="DIR", help=PROFILE_HELP.format(what="generation"))
    sampler_flags(s)
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("chat", help="interactive multi-turn chat (Gemma 4 chat template; a line /image PATH "
                                    "adds an image to the next message)")
    s.add_argument("--system", default="")
    s.add_argument("--thinking", action="store_true", help="enable thinking (never fed back into history)")
    s.add_argument("--context", type=positive(int), default=4096, help="KV cache tokens")
    s.add_argument("--max-soft-tokens", type=int, choices=SOFT_TOKEN_BUDGETS, dest="max_soft_tokens", default=None,
                   help="tokens per /image (default: the checkpoint's, 280 for the released model)")
    s.add_argument("--quiet", action="store_true", help="no load / compile progress and no per-turn stats")
    s.add_argument("--show-steps", action="store_true",
                   help="draw each answer's canvas converging step by step, on stderr (stdout keeps the answers)")
    s.add_argument("--plain", action="store_true", help="with --show-steps: one line per step, no colours")
    lora_flag(s)
    mesh_flags(s)
    sampler_flags(s)
    s.set_defaults(fn=cmd_chat)

    s = sub.add_parser("convert", help="Hugging Face safetensors or gemma-library orbax (or a dgemma_jax checkpoint, "
                                       "to quantize it) -> dgemma_jax checkpoint")
    s.add_argument("src", help="a checkpoint directory, a gs:// (fsspec) URL, or a Hugging Face Hub repo id[@revision]")
    s.add_argument("dst", help="a local directory")
    s.add_argument("--revision", default=None, help="Hub revision of SRC (branch, tag or commit)")
    s.add_argument("--from", dest="from_format", choices=["hf", "gemma", "dgemma"], default=None,
                   help="the source's format (default: detected); dgemma: a dgemma_jax checkpoint, re-written "
                        "(e.g. with --quantize int8)")
    s.add_argument("--preset", default=None, help="model preset of a gemma-layout checkpoint (default: the 26B)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"])
    s.add_argument("--force", action="store_true", help="replace an existing, non-empty destination")
    s.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="write weight-only int8 (per channel) or int4 (group-wise) expert, attention and MLP kernels "
                        "(read back as they are)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("train", help="train or fine-tune from an ml_collections recipe in configs/")
    s.add_argument("--config", required=True)
    s.add_argument("--set", action="append", help="override a config value: key.sub=value")
    s.add_argument("--profile", metavar="DIR", help=PROFILE_HELP.format(what="whole run (keep it short)"))
    s.set_defaults(fn=cmd_train)

    # every argument, --help included, goes to the benchmark's own parser (`dgemma bench --help` lists
    # its options): no option prefix of its own, so none is taken for this subcommand
    s = sub.add_parser("bench", help="run the CPU benchmarks (benchmarks/bench_cpu.py; --help lists its options)",
                       add_help=False, prefix_chars="+")
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)
