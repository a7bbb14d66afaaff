"""`dgemma serve`: the OpenAI-compatible server from the command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from dgemma_jax.compile_cache import CompileCounter
from dgemma_jax.engine.placement import PARAM_LAYOUTS
from dgemma_jax.errors import UsageError
from dgemma_jax.cli_run import (PROFILE_HELP, checkpoint_flags, compiled_flag, load_model_for_cli, mesh_flags,
                                runtime_for, use_compiled)
from dgemma_jax.model.quant import QUANTIZE_CHOICES
from dgemma_jax.parallel.profiling import profile
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.serving.planner import POLICIES

DEFAULT_CONTEXT = 8192     # KV-cache tokens per slot when --context is not given (capped at the model's)
API_KEY_ENV = "DGEMMA_API_KEY"   # the API key when --api-key is not given


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {s!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {v}")
    return v


def _lora_spec(s: str) -> tuple[str, str]:
    """--lora NAME=PATH: (the model name requests send, a LoRA run's directory)."""
    name, sep, path = s.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (the model name requests send = a LoRA run's work "
                                         f"directory), got {s!r}")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{s!r}: {path} is no directory (give a `dgemma train` LoRA run's work "
                                         "directory or one of its checkpoints/<step>)")
    return name, path


def load_adapters(args, cfg, name: str) -> dict:
    """{name: Adapter} of the --lora flags, each loaded and checked against the model (UsageError)."""
    # deferred: training's adapter reader (orbax) loads only when the server serves adapters
    from dgemma_jax.training.adapters import load_adapter

    out: dict = {}
    for n, path in args.lora or ():
        if n == name or n in out:
            raise UsageError(f"--lora {n}={path}: the name {n!r} is taken (by "
                             f"{'the base model' if n == name else 'another --lora'}); give each adapter its own name")
        try:
            out[n] = load_adapter(path, cfg)
        except ValueError as e:
            raise UsageError(f"--lora {n}={path}: {e}") from None
    return out


def cmd_serve(args) -> int:
    # deferred: the serving runtime loads only when `dgemma serve` runs, not for every `dgemma` command
    from dgemma_jax.serving.scheduler import Scheduler
    from dgemma_jax.serving.server import bind_socket, serve  # deferred: its web stack takes ~0.6 s to import

    image_dirs = []
    for d in args.allowed_image_dirs or ():
        if not os.path.isdir(d):
            print(f"dgemma: error: --allowed-image-dir {d}: no such directory", file=sys.stderr)
            return 2
        image_dirs.append(os.path.realpath(d))
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:   # before the model loads: a port in use is one line now, not a failure minutes later
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"dgemma: error: cannot listen on {args.host}:{args.port} ({e.strerror or e}): pick another --port "
              "(or stop what holds it) or --host", file=sys.stderr)
        return 2
    cfg, params, sampler, tok, shardings = load_model_for_cli(args)
    if args.max_soft_tokens is not None and cfg.vision is None:
        print(f"dgemma: error: --max-soft-tokens: {cfg.name} is a text-only checkpoint (no vision tower)",
              file=sys.stderr)
        return 2
    if sampler is None:  # a checkpoint without generation settings: the released defaults
        sampler = SamplerConfig.for_model(cfg)
    use_compiled(args, cfg, shardings)
    name = args.served_model_name or cfg.name
    adapters = load_adapters(args, cfg, name)
    context = min(args.context or DEFAULT_CONTEXT, cfg.max_position_embeddings)
    scheduler = Scheduler.for_model(cfg, params, tok, sampler, max_steps=args.max_steps, shardings=shardings,
                                    runtime=runtime_for(args), adapters=adapters,
                                    slots=args.slots, context=context, max_queue=args.max_queue,
                                    prefill_chunk=args.prefill_chunk, prefix_reuse=args.prefix_reuse,
                                    policy=args.schedule, param_layouts=args.param_layouts)
    del params   # the engine holds them (moved to the tick's layouts at start-up on a TPU: one copy, not two)
    compiles = CompileCounter()
    scheduler.start(wait=False)
    listening = threading.Event()
    port = sock.getsockname()[1]

    def on_listening() -> None:   # uvicorn accepts connections on the bound socket
        print(f"dgemma serve: listening on http://{args.host}:{port}/v1{' (API key required)' if api_key else ''}; "
              f"compiling {len(scheduler.runner.programs)} programs for {args.slots} slot(s) x {context} tokens "
              "(/health answers 503 \"starting\" until they are ready)", file=sys.stderr, flush=True)
        listening.set()

    def announce() -> None:
        while not (scheduler.ready.wait(0.2) and listening.wait(0.2)):
            if scheduler.error is not None:
                print(f"dgemma: error: the server could not compile its programs: {scheduler.error}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's shutdown; the exit status says it failed
                return
        need = scheduler.runner.memory.get("slot_tick", {}).get("total_bytes", 0)
        print(f"dgemma serve: {name} ready: {args.slots} slot(s), context {context} tokens per slot, canvas "
              f"{sampler.canvas_length}, up to {scheduler.engine.sampler.max_denoising_steps} steps per canvas; "
              f"ready {scheduler.stats['startup_compile_ms'] / 1e3:.1f} s after the start of compilation "
              f"({compiles.summary()}); the denoise tick needs {need / 2 ** 20:.1f} MiB (parameters, cache "
              "and temporaries, XLA's memory analysis)", file=sys.stderr, flush=True)

    threading.Thread(target=announce, name="dgemma-announce", daemon=True).start()
    with profile(args.profile):  # --profile DIR: a jax.profiler trace of the serving, written when the server stops
        drained = serve(scheduler, name, host=args.host, port=port, sock=sock, on_listening=on_listening,
                        drain_seconds=args.drain_seconds, log_level=args.log_level,
                        default_max_tokens=args.default_max_tokens, allowed_image_dirs=image_dirs,
                        max_soft_tokens=args.max_soft_tokens, max_body_bytes=args.max_body_bytes,
                        api_key=api_key, api_docs=args.api_docs, header_timeout=args.header_timeout,
                        body_timeout=args.body_timeout, decode_pixels=args.decode_pixels)
    if scheduler.error is not None and not scheduler.ready.is_set():
        return 1
    return 0 if drained else 1


def add_command(sub, positive) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching over N slots")
    checkpoint_flags(s)
    compiled_flag(s)
    s.add_argument("--dtype", choices=["float32", "bfloat16"])
    s.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                   help="weight-only int8 (per channel) or int4 (group-wise) kernels, quantized on load; auto: the "
                        "first of none/int8/int4 whose weights fit the devices' memory (none on CPU); default none")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000, help="0-65535 (0: any free port, printed when listening)")
    s.add_argument("--api-key", dest="api_key", default=None,
                   help=f"clients must send Authorization: Bearer KEY on every route but /health and /metrics "
                        f"(401 without; default: ${API_KEY_ENV}, else none)")
    s.add_argument("--enable-api-docs", action="store_true", dest="api_docs",
                   help="serve /docs, /redoc and /openapi.json (default off)")
    s.add_argument("--header-timeout", type=positive(float), dest="header_timeout", default=10.0,
                   help="seconds a connection has to send a request's line and headers (default 10)")
    s.add_argument("--body-timeout", type=positive(float), dest="body_timeout", default=30.0,
                   help="seconds a request has to send its body once its headers are in (HTTP 408; default 30)")
    s.add_argument("--slots", type=positive(int), default=8, help="requests denoised together (one cache row each)")
    s.add_argument("--context", type=positive(int), default=None,
                   help=f"KV-cache tokens per slot: prompt + all but the last canvas (default {DEFAULT_CONTEXT}, "
                        "capped at the model's positions)")
    s.add_argument("--max-queue", type=positive(int), default=256, dest="max_queue",
                   help="waiting sequences beyond which requests get HTTP 429")
    s.add_argument("--max-steps", type=positive(int), default=64, dest="max_steps",
                   help="the most denoising steps per canvas a request may ask for (default 64, at least the "
                        "checkpoint's own)")
    s.add_argument("--default-max-tokens", type=positive(int), default=256, dest="default_max_tokens",
                   help="a request's max_tokens when it sends none (capped to what fits)")
    s.add_argument("--prefill-chunk", type=positive(int), default=512, dest="prefill_chunk",
                   help="prompts are prefilled in chunks of this many tokens (two compiled widths serve every length)")
    s.add_argument("--no-prefix-reuse", action="store_false", dest="prefix_reuse",
                   help="prefill every prompt whole (default: a prompt that begins with what a free slot holds, "
                        "such as a chat's earlier turns, prefills only the rest, and each slot keeps its last "
                        "answer in its cache for that)")
    s.add_argument("--schedule", choices=POLICIES, default="preempt",
                   help="with every slot busy: 'preempt' (default) lets a waiting request of higher priority or "
                        "much less work take the slot of a running one at a canvas boundary (its cache row kept "
                        "in host memory and restored later, same tokens); 'fcfs' never preempts")
    s.add_argument("--allowed-image-dir", action="append", dest="allowed_image_dirs", default=None, metavar="DIR",
                   help="chat image parts may name local files (file:///... or an absolute path) under DIR "
                        "(repeatable; default none: images come as data URLs only)")
    s.add_argument("--max-soft-tokens", type=int, choices=[70, 140, 280, 560, 1120], default=None,
                   dest="max_soft_tokens",
                   help="each image's soft-token budget (its prompt tokens; default the image processor's, 280)")
    s.add_argument("--max-decode-pixels", type=positive(int), dest="decode_pixels", default=100_000_000,
                   help="image pixels decoded at once across requests (read from each image's header first; "
                        "a request whose images would pass it waits; default 100,000,000, about 0.3-1 GB of "
                        "memory)")
    mesh_flags(s, rules="serving")
    s.add_argument("--param-layouts", choices=PARAM_LAYOUTS, default="auto", dest="param_layouts",
                   help="'compiler': at start-up the weights move to the layouts the TPU compiler prefers for the "
                        "denoise tick (else the tick re-lays the attention weights out at every call); 'default': "
                        "as loaded; 'auto' (default): 'compiler' on a TPU without --lora, else 'default'")
    s.add_argument("--served-model-name", dest="served_model_name", default=None,
                   help="the model id clients send (default: the checkpoint's name)")
    s.add_argument("--lora", action="append", type=_lora_spec, default=None, metavar="NAME=PATH",
                   help="serve a LoRA adapter beside the model as model NAME (repeatable): PATH is a `dgemma train` "
                        "LoRA run's work directory (its latest checkpoint) or one of its checkpoints/<step>; a "
                        "request's model picks the base or an adapter, and adapters mix in one batch")
    s.add_argument("--drain-seconds", type=positive(float), dest="drain_seconds", default=None,
                   help="on SIGTERM, wait at most this long for the generations in flight (default: until they "
                        "finish; a request whose body is still arriving gets 503 at once; a second SIGTERM exits "
                        "at once, status 1)")
    s.add_argument("--max-body-bytes", type=positive(int), dest="max_body_bytes", default=None,
                   help="the largest request body; larger ones get HTTP 413 (default: 64 bytes per token of "
                        "--context plus 64 KiB, plus one 32 MiB image as a data URL for a checkpoint with "
                        "a vision tower)")
    s.add_argument("--log-level", dest="log_level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--profile", metavar="DIR",
                   help=PROFILE_HELP.format(what="requests served until the server stops (Ctrl-C / SIGTERM)"))
    s.set_defaults(fn=cmd_serve)

