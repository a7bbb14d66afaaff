"""Worker for the two-process test: join a gloo cluster on 127.0.0.1, generate on the global mesh.

usage: mp_generate.py PORT NUM_PROCESSES PROCESS_ID OUT.npy   (NUM_PROCESSES=0: single process)
"""

import os
import sys

port, nproc, pid, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // max(nproc, 1)}"

from dgemma_jax.parallel import distributed  # noqa: E402

if nproc:
    distributed.initialize(f"127.0.0.1:{port}", nproc, pid)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dgemma_jax import ModelConfig  # noqa: E402
from dgemma_jax.engine import Engine  # noqa: E402
from dgemma_jax.parallel import Shardings, fetch, make_mesh  # noqa: E402
from dgemma_jax.sampling import SamplerConfig  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
cfg = ModelConfig.preset("tiny-6layer", num_heads=8, num_kv_heads=4, num_global_kv_heads=2, num_layers=2,
                         layer_types=("sliding", "global"))
sh = Shardings(cfg, make_mesh("expert=2,tensor=4"), "latency")
params = sh.init_params(jax.random.key(0))
sampler = SamplerConfig(canvas_length=16, max_denoising_steps=4, eos_ids=(1,))
tokens = np.random.RandomState(0).randint(3, cfg.vocab_size, (2, 20)).astype(np.int32)
out_ = Engine(cfg, params, sampler, shardings=sh).generate(tokens, np.array([20, 13]), rng=0, max_new_tokens=32)
toks = fetch(out_.tokens)
if distributed.is_main_process():
    np.save(out, toks)
