"""Evaluation with the real sampler (`Engine.generate`): exact-match accuracy, denoising steps,
tokens per forward pass, and a sweep over `max_denoising_steps`."""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np

from dgemma_jax.config import ModelConfig
from dgemma_jax.engine import Engine
from dgemma_jax.io.images import ImageSettings, preprocess_images, prompt_with_images, settings_for
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import seed_key


def pad_prompts(prompts: Sequence[Sequence[int]], width: int, pad_id: int = 0):
    """Right-pad token lists to [B, width] -> (tokens int32, lengths int32)."""
    toks = np.full((len(prompts), width), pad_id, np.int32)
    lens = np.zeros((len(prompts),), np.int32)
    for i, p in enumerate(prompts):
        p = list(p)[-width:]
        toks[i, : len(p)] = p
        lens[i] = len(p)
    return toks, lens


def evaluate_exact_match(config: ModelConfig, params: Any, sampler: SamplerConfig, tokenizer,
                         pairs: Sequence[tuple[str, str]], *, prompt_width: int, max_new_tokens: int,
                         batch_size: int = 100, seed: int = 0, engine=None, keep: int = 8,
                         images: Sequence[Any] | None = None, image_settings: ImageSettings | None = None
                         ) -> dict[str, Any]:
    """Generate an answer for each (prompt, answer) pair and score exact string match.

    Prompts are BOS + tokenizer.encode(prompt), right-padded to `prompt_width` (one compiled shape;
    the last batch is padded with copies and the copies are not scored). images: one picture per pair
    (uint8 arrays, PIL images or paths), placed before its prompt's text as `prompt_with_images` does
    and preprocessed with `image_settings` (default: the checkpoint's, `settings_for`). Returns accuracy, per-row
    denoiser passes, mean steps per canvas, tokens per forward pass (HF's metric), a few samples
    (the first `keep`) and a few failures (the first `keep` wrong answers).
    """
    # one batched program per batch (throughput: the batch-invariant default runs rows one by one) with
    # the keys split(seed + s, batch_size): the recorded evaluations' keys; results are reproducible for
    # a given batch_size
    engine = engine or Engine(config, params, sampler, batch_invariant=False)
    n = len(pairs)
    correct, tpf, steps_per_canvas, passes = [], [], [], []
    samples, failures = [], []
    t0 = time.time()
    for s in range(0, n, batch_size):
        chunk = list(pairs[s:s + batch_size])
        real = len(chunk)
        chunk += [chunk[-1]] * (batch_size - real)
        batch = None
        if images is None:
            ids = [[tokenizer.bos_id] + tokenizer.encode(p) for p, _ in chunk]
        else:
            pics = list(images[s:s + batch_size])
            batch = preprocess_images(pics + [pics[-1]] * (batch_size - real),
                                      image_settings or settings_for(config))
            ids = [prompt_with_images(config, tokenizer, p, batch.select([i]))[0][0] for i, (p, _) in enumerate(chunk)]
        toks, lens = pad_prompts(ids, prompt_width, config.pad_id)
        keys = jax.random.split(seed_key(seed + s), batch_size)
        out = engine.generate(toks, lens, rng=keys, max_new_tokens=max_new_tokens, images=batch)
        gen = np.asarray(out.tokens)[:real]
        st = np.asarray(out.steps)[:real]
        tp = np.asarray(out.tokens_per_forward(sampler.pad_id))[:real]
        for i in range(real):
            ids = gen[i].tolist()
            end = next((j for j, t in enumerate(ids) if t in sampler.eos_ids), len(ids))
            text = tokenizer.decode(ids[:end])  # the answer: the tokens before the first EOS
            ok = text == chunk[i][1]
            correct.append(ok)
            row = {"prompt": chunk[i][0], "target": chunk[i][1], "output": text, "correct": bool(ok)}
            if len(samples) < keep:
                samples.append(row)
            if not ok and len(failures) < keep:
                failures.append(row)
        tpf.extend(tp.tolist())
        passes.extend(st.sum(-1).tolist())
        steps_per_canvas.extend(st[st > 0].tolist())
    return {
        "n": n,
        "accuracy": float(np.mean(correct)),
        "correct": int(np.sum(correct)),
        "mean_steps_per_canvas": float(np.mean(steps_per_canvas)) if steps_per_canvas else 0.0,
        "mean_passes_per_example": float(np.mean(passes)),
        "tokens_per_forward": float(np.mean(tpf)),
        "seconds": time.time() - t0,
        "samples": samples,
        "failures": failures,
    }


def sweep_steps(config: ModelConfig, params: Any, sampler: SamplerConfig, tokenizer, pairs, *,
                steps: Sequence[int] = (1, 2, 4, 8, 16, 48), **kw) -> list[dict[str, Any]]:
    """`evaluate_exact_match` for each max_denoising_steps value (other sampler knobs fixed)."""
    rows = []
    for n in steps:
        r = evaluate_exact_match(config, params, sampler.replace(max_denoising_steps=int(n)), tokenizer, pairs, **kw)
        r = {k: v for k, v in r.items() if k not in ("samples", "failures")}
        rows.append({"max_denoising_steps": int(n), **r})
    return rows
