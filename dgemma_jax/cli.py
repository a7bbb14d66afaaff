"""The `dgemma` command: generate, chat, convert, train, bench, compile, inspect.

Errors the user can fix (bad flags, missing checkpoints, prompts too long, ...) print one line
`dgemma: error: ...` and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dgemma_jax import cli_run, compile_cache
from dgemma_jax.cli_run import checkpoint_flags
from dgemma_jax.config import ModelConfig
from dgemma_jax.errors import UsageError, print_warnings_as_lines
from dgemma_jax.io.bundled import bundled_choice, bundled_dir
from dgemma_jax.io import locations
from dgemma_jax.io.model_dir import read_checkpoint
from dgemma_jax.parallel import distributed
from dgemma_jax.model.quant import weight_bytes
from dgemma_jax.parallel.mesh import make_mesh
from dgemma_jax.axis_rules import RULE_SETS, rules_for
from dgemma_jax.serving import cli as serve_cli


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in ONE line (`dgemma: error: ...`) and exits with 2."""

    def error(self, message):
        where = f"{self.prog.split()[-1]}: " if " " in self.prog else ""
        self.exit(2, f"dgemma: error: {where}{message} (see {self.prog} --help)\n")


def _positive(kind):
    def parse(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s!r}")
        return v

    return parse


# ---------------------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    if args.checkpoint and args.preset:
        raise UsageError("pass --checkpoint or --preset, not both")
    if args.preset:
        cfg = ModelConfig.preset(args.preset)
    else:  # like every other command: a checkpoint, by default the bundled model
        is_bundled, name = bundled_choice(args.checkpoint)
        if is_bundled:
            if args.revision is not None:
                raise UsageError("--revision applies to a Hugging Face Hub checkpoint; pass --checkpoint REPO_ID too")
            try:
                cfg = read_checkpoint(bundled_dir(name)).config
            except FileNotFoundError as e:
                raise UsageError(str(e)) from None
        else:  # a remote checkpoint: its config files only, not the weights
            local = locations.kind(args.checkpoint) == "local"
            cfg = read_checkpoint(locations.resolve(args.checkpoint, args.revision, files="all" if local else "config"),
                                  need_weights=local).config
    counts = cfg.param_count()
    bytes_per = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.param_dtype]
    info = {
        "name": cfg.name,
        "layers": cfg.num_layers,
        "layer_types": "".join("G" if t == "global" else "s" for t in cfg.layer_types),
        "hidden": cfg.hidden_size,
        "heads": cfg.num_heads,
        "sliding_kv_heads x head_dim": f"{cfg.num_kv_heads} x {cfg.head_dim}",
        "global_kv_heads x head_dim": f"{cfg.num_global_kv_heads} x {cfg.global_head_dim} (K=V)",
        "window": cfg.sliding_window,
        "experts": f"{cfg.num_experts} top-{cfg.top_k} x {cfg.moe_intermediate_size} + dense {cfg.intermediate_size}",
        "vocab": cfg.vocab_size,
        "canvas": cfg.canvas_length,
        "params_total": counts["total"],
        "params_active_per_token": counts["active"],
    }
    vis = counts.get("vision", 0)
    if cfg.vision is not None:
        v = cfg.vision
        info["vision"] = (f"{v.num_layers} layers x {v.hidden_size}, {v.num_heads} heads x {v.head_dim}, "
                          f"patch {v.patch_size}, pool {v.pooling_kernel_size}x{v.pooling_kernel_size}")
        info["params_vision"] = vis
    info.update({
        "param_dtype": cfg.param_dtype,
        "memory_bytes": {"checkpoint (" + cfg.param_dtype + ")": (counts["total"] + vis) * bytes_per,
                         "float32": (counts["total"] + vis) * 4, "bfloat16": (counts["total"] + vis) * 2,
                         # from the quantized parameters' shapes (scales, float embedding and norms included)
                         "int8": weight_bytes(cfg, "int8"), "int4": weight_bytes(cfg, "int4")},
    })
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            if k == "memory_bytes":
                v = ", ".join(f"{d}: {b / 1e9:.3f} GB" for d, b in v.items())
            elif k.startswith("params_"):
                v = f"{v:,} ({v / 1e9:.3f} B)"
            print(f"{k:>26}: {v}")
    return 0


# ---------------------------------------------------------------------------- compile
def cmd_compile(args) -> int:
    from dgemma_jax.perf import aot  # deferred: the AOT compile reports (~10 ms) load only for `dgemma compile`

    if args.topology not in aot.TOPOLOGIES:
        raise UsageError(f"unknown --topology {args.topology!r}; choose one of {', '.join(aot.TOPOLOGIES)}")
    programs = tuple(p.strip() for p in args.programs.split(",") if p.strip())
    known = ("prefill", "denoise_step", "commit", "commit_step", "generate", "lora_step", "rl_step", "slot_tick",
             "prefill_slot", "prefill_images", "prefill_slot_images")
    bad = [p for p in programs if p not in known]
    if bad:
        raise UsageError(f"unknown program(s) {bad}; choose from {', '.join(known)}")
    if args.images < 0:
        raise UsageError(f"--images must be >= 0; got {args.images}")
    if args.explain_memory < 0:
        raise UsageError(f"--explain-memory must be >= 0 (0: off); got {args.explain_memory}")
    if args.images and not {"prefill_images", "prefill_slot_images"} & set(programs):
        # the image prefill of the path asked for: the server's one-slot chunk, else the batch prefill
        serving = {"slot_tick", "prefill_slot"} & set(programs)
        programs += ("prefill_slot_images" if serving else "prefill_images",)
    options = {}
    for item in args.xla_option:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--xla-option takes KEY=VALUE (e.g. xla_tpu_enable_latency_hiding_scheduler=true); "
                             f"got {item!r}")
        options[key.strip()] = value.strip()
    progress = _compile_progress
    devices = None
    if not args.save:
        # a TPU program compiled here cannot be read back without a TPU client: the persistent cache
        # would store it, and a later compile of the same program would warn and compile it again
        compile_cache.enable("off")
    else:
        devices = aot.tpu_devices(args.topology)
        cfg = ModelConfig.preset(args.preset)
        if args.dtype:
            cfg = cfg.replace(dtype=args.dtype, param_dtype=args.dtype)
        mesh = dict(make_mesh(args.mesh or f"expert={len(devices)}", devices=devices).shape)
        ident = compile_cache.identity(cfg, devices, mesh=mesh, rules=args.rules, quantize=args.quantize,
                                       layers="scan" if args.layers == "scan" else "unrolled")
        compile_cache.use_compiled_dir(args.save, ident)
        progress = _saving_progress(args.save)
    try:
        report = aot.compile_report(args.preset, args.topology, mesh=args.mesh, rules=args.rules,
                                    batch=args.batch, context=args.context, prompt=args.prompt,
                                    steps_per_canvas=args.steps, programs=programs, dtype=args.dtype,
                                    moe_dispatch=args.moe_dispatch, progress=progress, devices=devices,
                                    quantize=args.quantize, images=args.images, layers=args.layers,
                                    compiler_options=options, explain_memory=args.explain_memory,
                                    rl=dict(num_samples=args.rl_samples, updates=args.rl_updates),
                                    param_formats=_param_formats(args.param_layouts, programs))
    except (RuntimeError, ValueError) as e:
        raise UsageError(str(e)) from None
    if args.save:
        with open(os.path.join(args.save, compile_cache.MANIFEST)) as f:
            report["saved"] = {"directory": args.save, **json.load(f)}
    _print_compile_report(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if not report["fits"]:
        print(f"dgemma: error: {aot.fix_hint(report)}", file=sys.stderr)
        return 3
    return 0


def _saving_progress(directory):
    """`_compile_progress`, and each compiled program recorded in the --save directory's manifest."""
    before = {}

    def progress(name, index, count, seconds, entry):
        _compile_progress(name, index, count, seconds, entry)
        if seconds is None:
            before[name] = compile_cache.entries(directory)
        elif "error" not in entry:
            saved = compile_cache.record_program(directory, name, seconds, before[name])
            entry["saved"] = saved
            sys.stderr.write(f"    saved {name}: {len(saved['cache_keys'])} executable(s), "
                             f"{saved['bytes'] / 2 ** 20:.1f} MiB\n")

    return progress


def _compile_progress(name, index, count, seconds, entry):
    """One stderr line per program: what is compiling, then how long it took and whether it fits
    (a 26B program compiles for minutes; the table comes only at the end)."""
    if seconds is None:
        sys.stderr.write(f"[{index + 1}/{count}] compiling {name} ...")
    elif "error" in entry:
        sys.stderr.write(f" does not fit ({seconds:.1f} s)\n")
    else:
        sys.stderr.write(f" {seconds:.1f} s, {entry['total_bytes'] / 1e9:.2f} GB per chip"
                         f"{'' if entry['fits'] else ', does NOT fit'}\n")
    sys.stderr.flush()


def _param_formats(choice: str, programs) -> str:
    """`dgemma compile --param-layouts`: auto is what the programs run with, "compiler" where the server's
    tick is among them (`dgemma serve` on a TPU places its weights in the tick's layouts), else "default"."""
    if choice == "auto":
        return "compiler" if "slot_tick" in programs else "default"
    return choice


def _print_compile_report(r):
    gb = 1e9
    print(f"{r['preset']} on {r['topology']} ({r['chips']} chips, mesh {r['mesh']}, rules {r['rules']}), "
          f"batch {r['batch']}, context {r['context']}, {r['dtype']}"
          f"{' weights int8' if r.get('quantize') == 'int8' else ''}, moe {r['moe_dispatch']}, "
          f"layers {r.get('layers', 'unrolled')}"
          + (f", weights in the layouts {r['param_formats_from']} prefers" if r.get("param_formats_from") else ""))
    print(f"{'program':>13} {'compile s':>9} {'args GB':>8} {'temp GB':>8} {'total GB':>8} {'limit GB':>8} "
          f"{'GFLOP':>9} {'GB counted':>10} {'GB HBM':>8} {'proj ms':>8}  fits")
    for name, e in r["programs"].items():
        if "error" in e:
            print(f"{name:>13}  does not fit: {e['error']}")
            continue
        m = e["memory"]
        print(f"{name:>13} {e['compile_seconds']:>9.1f} {m['argument_size_in_bytes'] / gb:>8.2f} "
              f"{m['temp_size_in_bytes'] / gb:>8.2f} {e['total_bytes'] / gb:>8.2f} {r['hbm_limit_bytes'] / gb:>8.2f} "
              f"{e['flops'] / 1e9:>9.1f} {e['bytes_accessed'] / gb:>10.2f} {e['hbm_bytes'] / gb:>8.2f} "
              f"{1e3 * e['projected_seconds']:>8.2f}  "
              f"{'yes' if e['fits'] else 'NO'}")
    if "projection" in r:
        p = r["projection"]
        print("projected from the TPU compiler's output (FLOPs, HBM traffic), not a measurement: "
              f"denoise step {p['denoise_step_ms']:.2f} ms, "
              f"{p['steps_per_canvas']} steps + commit = {p['per_canvas_ms']:.1f} ms per canvas, "
              f"{p['tokens_per_second']:.0f} tokens/s")
        if "denoise_step_ici_ms" in p and r["chips"] > 1:
            print(f"with the step's collectives on the ICI ({p['denoise_step_ici_ms']:.2f} ms, perf/collectives.py): "
                  f"{p['denoise_step_ms_with_ici']:.2f} ms run after the HBM-bound work, "
                  f"{p['denoise_step_ms_ici_overlapped']:.2f} ms hidden under it")
    if "rl" in r:
        q = r["rl"]
        rollout = ("" if q["rollout_seconds"] is None else
                   f"rollout of {q['rows']} rows ({q['canvases']} canvas(es) x {q['steps_per_canvas']} steps) "
                   f"{q['rollout_seconds']:.3f} s + ")
        total = "" if q["step_seconds"] is None else f" = {q['step_seconds']:.3f} s per RL step"
        print(f"RL step projected from the TPU compiler's output, not a measurement: {rollout}update "
              f"{q['update_seconds']:.3f} s{total}")
    for name, e in r["programs"].items():
        if "memory_peak" in e:
            _print_memory_peak(name, e["memory_peak"])


def _print_memory_peak(name, peak):
    """`--explain-memory`: what the compiler holds at a program's memory peak (perf.memory_peak)."""
    kinds = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(peak["bytes_by_kind"].items(), key=lambda kv: -kv[1]))
    print(f"{name}: at its memory peak {peak['peak_bytes'] / 1e9:.2f} GB live ({kinds} GB); the largest buffers "
          "besides the parameters:")
    for b in peak["largest"]:
        print(f"  {b['bytes'] / 2 ** 20:9.1f} MiB  {b['kind']:<9}  {b['shape'].split('{')[0]:<24}  {b['op'] or b['name']}")


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dgemma", description="DiffusionGemma in JAX: generate, chat, serve, convert, "
                                "train, bench, compile, inspect")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser("inspect", help="config, parameter counts (total/active), memory by dtype")
    s.add_argument("--preset", default=None, choices=ModelConfig.preset_names(),
                   help="describe a preset instead of a checkpoint (e.g. diffusiongemma-26b-a4b)")
    checkpoint_flags(s, weights=False)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("compile", help="AOT-compile for a TPU topology from this machine: fit and projected speed")
    s.add_argument("--preset", default="diffusiongemma-26b-a4b", choices=ModelConfig.preset_names())
    s.add_argument("--topology", default="v5e-8", help="v5e-4/8/16, v6e-4/8/16, v5p-8/16, v4-8/16")
    s.add_argument("--mesh", default=None,
                   help="axis=size list over data,fsdp,tensor,expert (default: every chip on expert)")
    s.add_argument("--rules", default="latency", choices=list(RULE_SETS))
    s.add_argument("--batch", type=_positive(int), default=1)
    s.add_argument("--context", type=_positive(int), default=32768, help="KV cache tokens per row")
    s.add_argument("--prompt", type=_positive(int), default=2048, help="tokens per prefill call")
    s.add_argument("--steps", type=_positive(int), default=16, help="denoising steps per canvas for projections")
    s.add_argument("--programs", default="prefill,denoise_step,commit_step,generate",
                   help="comma list of prefill, denoise_step, commit (a canvas's causal pass on its own), "
                        "commit_step (a canvas's commit and the next one's first step in one pass, as generate "
                        "runs them on a TPU; the projection's commit when compiled), generate, lora_step (a LoRA training "
                        "step on a batch of --batch rows of --prompt + canvases up to --context; use --rules training), "
                        "rl_step (GRPO's LoRA update on --batch rollout rows, likewise; with prefill, denoise_step, "
                        "commit and generate, the rollout of those rows: one RL step's projected time), "
                        "slot_tick, prefill_slot (the server's programs: --batch slots, one --prompt per prefill), "
                        "prefill_images, prefill_slot_images (with --images)")
    s.add_argument("--rl-samples", type=_positive(int), default=1,
                   help="rl_step: noise draws per canvas of the likelihood estimate (rl.num_samples; 1: the "
                        "compiler's cost counts the whole update, a loop body being counted once)")
    s.add_argument("--rl-updates", type=_positive(int), default=1, help="rl_step: rl.updates_per_rollout")
    s.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    s.add_argument("--moe-dispatch", choices=["auto", "ragged", "capacity", "dense", "gmm"], default="auto",
                   help="MoE dispatch the programs are compiled with (auto: on TPU gmm for int4 experts, ragged "
                        "otherwise; gmm: the Pallas grouped-matmul kernel)")
    s.add_argument("--layers", choices=["auto", "unrolled", "scan"], default="auto",
                   help="layer layout (Runtime.layers): scan = one repeated layer group compiled and scanned "
                        "(auto: Runtime.LAYER_DEFAULTS, unrolled; the entry points' own choice on TPU is "
                        "runtime.ENTRY_LAYERS: scan for generate, chat and the notebook, unrolled for serve)")
    s.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="compile for weight-only int8 or int4 parameters (dgemma_jax.model.quant)")
    s.add_argument("--images", type=int, default=0,
                   help="add the released vision tower and compile an image prefill with this many images "
                        "(280 soft tokens each) in the prompt: prefill_slot_images beside the server's programs, "
                        "else prefill_images")
    s.add_argument("--param-layouts", choices=["auto", "default", "compiler"], default="auto", dest="param_layouts",
                   help="the weights' memory layouts: compiler = those the TPU compiler prefers for the first program "
                        "(slot_tick when asked for), the others compiled for them, as dgemma serve places them on a "
                        "TPU; default = as loaded; auto (default): compiler with slot_tick, else default")
    s.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compiler option for the TPU compile (repeatable), recorded in the report")
    s.add_argument("--explain-memory", type=int, default=0, metavar="N",
                   help="list, per program, the N largest buffers live at its memory peak with the op that made "
                        "each, from XLA's buffer assignment (what to change when a program does not fit)")
    s.add_argument("--out", help="write the report as JSON here")
    s.add_argument("--save", metavar="DIR",
                   help="keep the compiled programs in DIR (serialized executables and a manifest saying what "
                        "they were compiled for), for `dgemma serve|generate --compiled DIR`")
    s.set_defaults(fn=cmd_compile)

    _add_more_commands(sub)
    return p


def _add_more_commands(sub):
    cli_run.add_commands(sub, _positive)
    serve_cli.add_command(sub, _positive)


def main(argv=None) -> int:
    print_warnings_as_lines()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if args.command != "compile":
        # (importing dgemma_jax dropped JAX's TPU probe on a machine without a TPU: backends.skip_absent_tpu)
        # one process of a multi-host run: join the others before any device is touched (a multi-host TPU
        # slice is found by itself; elsewhere DGEMMA_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID); one host: nothing
        distributed.initialize()
    compile_cache.enable()  # programs compiled by an earlier start are read back, not compiled again
    try:
        if isinstance(getattr(args, "rules", None), str):
            rules_for(args.rules)  # a typo'd --rules is an error with or without --mesh
        return int(args.fn(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"dgemma: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
