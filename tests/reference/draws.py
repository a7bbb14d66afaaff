"""The random draws of a generation, as arrays: what a run with a given `rng` consumes.

`Engine.generate(..., rng=r)` (and `stream`, `steps`, the functional `generate`) draw everything from
the row keys `row_keys(r, B)`: canvas c of row b uses `fold_in(row_key_b, c)`, its start canvas is
`initial_canvas`, and denoising step s uses `denoise_step_keys(canvas_keys, s)`: the samples come from
the head's uniforms (`fused.chunk_uniforms`, on the CPU head) and the renoise tokens from
`uniform_tokens`. `canvas_draws` evaluates those same functions, so an external implementation (the
transformers reference in tests/golden/trace_case.py) can be fed exactly the draws the engine makes,
and its run replayed through the real `Engine` with the same `rng`. Nothing here changes what the
engine does.

`categorical_from_uniforms` is the CPU head's sampling rule (a streaming inverse-CDF draw over vocab
chunks, see `fused.head_sample_stats`) applied to given probabilities, in float64 numpy: with the
engine's own probabilities it returns the engine's token up to float32 rounding at the boundaries.
The accelerator head samples with Gumbel noise instead (`head_sample_stats_full`); these draws
describe the CPU head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.sampling import ops
from dgemma_jax.sampling.fused import chunk_uniforms, vocab_chunk
from dgemma_jax.sampling.generate import canvas_keys
from dgemma_jax.sampling.loop import denoise_step_keys, initial_canvas, row_keys


def canvas_draws(rng, batch: int, canvas_index: int, num_steps: int, canvas_length: int,
                 vocab_size: int) -> dict[str, np.ndarray]:
    """The draws of canvas `canvas_index` for `batch` rows and up to `num_steps` denoising steps.

    rng: what `Engine.generate` takes (an int seed, a key, or [B] keys). Returns numpy arrays:
      start     [B, L] int32  the start canvas (used unless a seed canvas is given)
      uniforms  [N, B, n_chunks, 2, L] float32  the head's uniforms per step and vocab chunk
      noise     [N, B, L] int32  the renoise tokens per step
      chunk     []  the vocab chunk width (n_chunks = V / chunk)
    """
    keys = canvas_keys(row_keys(rng, batch), canvas_index)
    chunk = vocab_chunk(vocab_size)
    uniforms, noise = [], []
    for s in range(num_steps):
        sk = denoise_step_keys(keys, jnp.int32(s))
        uniforms.append(np.stack([np.asarray(chunk_uniforms(sk[:, 0], jnp.int32(i), canvas_length))
                                  for i in range(vocab_size // chunk)], axis=1))
        noise.append(np.asarray(jax.vmap(lambda k: ops.uniform_tokens(k, (canvas_length,), vocab_size))(sk[:, 1])))
    return {"start": np.asarray(initial_canvas(keys, canvas_length, vocab_size)), "uniforms": np.stack(uniforms),
            "noise": np.stack(noise), "chunk": np.asarray(chunk)}


def categorical_from_uniforms(probs: np.ndarray, uniforms: np.ndarray, chunk: int) -> np.ndarray:
    """The CPU head's draw from `probs` [..., V] (any positive masses) with `uniforms` [..., n_chunks, 2].

    Per vocab chunk c: the token inside the chunk inverts the chunk's cumulative mass at
    uniforms[c, 0] * mass_c; the running sample moves into chunk c when uniforms[c, 1] * mass_<=c <
    mass_c. Returns int64 token ids [...].
    """
    p = np.asarray(probs, np.float64)
    v = p.shape[-1]
    n = v // chunk
    sample = np.zeros(p.shape[:-1], np.int64)
    total = np.zeros(p.shape[:-1], np.float64)
    for c in range(n):
        w = p[..., c * chunk:(c + 1) * chunk]
        s_c = w.sum(-1)
        total = total + s_c
        target = uniforms[..., c, 0] * s_c
        inside = np.minimum((np.cumsum(w, -1) < target[..., None]).sum(-1), chunk - 1) + c * chunk
        sample = np.where(uniforms[..., c, 1] * total < s_c, inside, sample)
    return sample
