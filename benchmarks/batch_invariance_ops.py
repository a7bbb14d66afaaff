"""Which XLA:CPU ops make a row's result depend on the other rows of its batch (issue 46, point 3).

    PYTHONPATH=. python benchmarks/batch_invariance_ops.py [--out benchmarks/results/batch_invariance_ops.json]

Each op runs on a batch of B items of `rows` rows each and on every item alone (the same program shape
but batch 1); an item "differs" when any of its outputs is not bit-identical. Random float32 inputs.
- dense dot [B*rows, D] @ [D, F] (the model's projections, MLPs, head: M = rows of every item together),
  also with every call's M padded with zero rows to at least 64 (`pad64`);
- batched attention einsums (bqhd,bkhd->bhqk and back), where each item is its own dot;
- masked softmax over keys: an item alone with its own key length vs in a batch padded to a longer one;
- the same with the keys reduced in fixed blocks of 16 merged by log-sum-exp (padding adds whole masked blocks);
- row reductions (RMSNorm's mean of squares over D).
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

RNG = np.random.default_rng(0)


def _f32(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _pad_rows(x, m):
    return jnp.pad(x, ((0, max(m - x.shape[0], 0)), (0, 0)))


def dense(rows: int, batch: int, d: int, f: int, pad_to: int = 0) -> int:
    w, x = _f32(d, f), _f32(batch * rows, d)
    dot = jax.jit(lambda a, b: a @ b)
    big = np.asarray(dot(_pad_rows(x, pad_to), w))[: batch * rows]
    return sum(int((np.asarray(dot(_pad_rows(x[i * rows:(i + 1) * rows], pad_to), w))[:rows]
                    != big[i * rows:(i + 1) * rows]).any()) for i in range(batch))


def attention_einsum(q_len: int, k_len: int, batch: int, heads: int = 4, hd: int = 32) -> int:
    q, k = _f32(batch, q_len, heads, hd), _f32(batch, k_len, heads, hd)
    f = jax.jit(lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b))
    big = np.asarray(f(q, k))
    return sum(int((np.asarray(f(q[i:i + 1], k[i:i + 1]))[0] != big[i]).any()) for i in range(batch))


def masked_softmax(q_len: int, own: int, padded: int, batch: int, block: int = 0) -> int:
    """An item's attention output over its `own` keys alone vs with the keys padded (masked) to `padded`."""
    s, v = _f32(batch, q_len, padded), _f32(batch, padded, 32)

    def attend(scores, values, n):
        mask = jnp.arange(scores.shape[-1]) < n
        scores = jnp.where(mask, scores, -jnp.inf)
        if not block:
            return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), values)
        b, q, k = scores.shape
        sb = scores.reshape(b, q, k // block, block)
        m = sb.max(-1)
        p = jnp.exp(sb - jnp.where(jnp.isfinite(m), m, 0)[..., None])
        part = jnp.einsum("bqnk,bnkd->bqnd", p, values.reshape(b, k // block, block, -1))
        lse_m = m.max(-1, keepdims=True)
        scale = jnp.where(jnp.isfinite(m), jnp.exp(m - lse_m), 0.0)
        out = jnp.zeros(part.shape[:2] + part.shape[3:], part.dtype)
        total = jnp.zeros(part.shape[:2], part.dtype)
        for j in range(k // block):  # a fixed merge order: block by block
            out = out + part[:, :, j] * scale[..., j, None]
            total = total + p[:, :, j].sum(-1) * scale[..., j]
        return out / total[..., None]

    f = jax.jit(attend, static_argnums=2)
    big = np.asarray(f(s, v, own))
    return sum(int((np.asarray(f(s[i:i + 1, :, :own], v[i:i + 1, :own], own))[0] != big[i]).any())
               for i in range(batch))


def rms(rows: int, batch: int, d: int) -> int:
    x = _f32(batch * rows, d)
    f = jax.jit(lambda a: jnp.mean(a * a, -1))
    big = np.asarray(f(x))
    return sum(int((np.asarray(f(x[i * rows:(i + 1) * rows])) != big[i * rows:(i + 1) * rows]).any())
               for i in range(batch))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_invariance_ops.json"))
    args = ap.parse_args()
    batch = 8
    out = {"what": f"items (of {batch}) whose output in the batch is not bit-identical to the item alone",
           "device": f"XLA:CPU ({platform.processor() or platform.machine()}), jax {jax.__version__}",
           "dense_dot": {}, "dense_dot_pad64": {}, "attention_einsum": {}, "masked_softmax": {},
           "masked_softmax_blocked16": {}, "rms_mean": {}}
    for rows in (1, 8, 16, 17, 32, 48, 64, 100, 256):
        for d, f in ((64, 96), (256, 1024)):
            key = f"rows={rows} D={d} F={f}"
            out["dense_dot"][key] = dense(rows, batch, d, f)
            out["dense_dot_pad64"][key] = dense(rows, batch, d, f, pad_to=64)
        out["rms_mean"][f"rows={rows} D=256"] = rms(rows, batch, 256)
    for q_len in (8, 16, 256):
        out["attention_einsum"][f"q={q_len} k=48"] = attention_einsum(q_len, 48, batch)
        for own, padded in ((32, 48), (48, 64), (32, 256)):
            out["masked_softmax"][f"q={q_len} own={own} padded={padded}"] = masked_softmax(q_len, own, padded, batch)
            out["masked_softmax_blocked16"][f"q={q_len} own={own} padded={padded}"] = \
                masked_softmax(q_len, own, padded, batch, block=16)
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
