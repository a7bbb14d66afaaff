"""Visual digit tasks for training the image path from scratch: digits drawn into a picture by Pillow,
a text instruction, the answer as text.

    task = ImageDigitTask("sort", "sort the digits in the image", min_len=4, max_len=6)
    image, prompt, answer = task.sample(np.random.default_rng(0))   # uint8 [16, 1120, 3], str, "013579"

Each picture is an `IMAGE_SIZE` (width x height) strip with the digits in 16-pixel cells from the left
edge: a random font size, small shifts, ink and paper shade and pixel noise, so that no two pictures of
one string are alike. `ImageTaskSource` lays the prompts out as the CLI and `Engine` do at inference (`<bos>`, the
image's `<|image>` + `<|image|>` x n + `<image|>`, then the instruction; `prompt_with_images`) and
preprocesses the pictures with the checkpoint's image processor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from dgemma_jax.io.images import (BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN, preprocess_images, prompt_with_images,
                                  settings_for)
from dgemma_jax.training.data import Layout, Source, collate
from dgemma_jax.training.tasks import digit_string

# width, height: a strip of 70 patches of 16 x 16 pixels, the 70-token budget's size for this aspect
# ratio (the processor keeps it as it is), one digit per patch
IMAGE_SIZE = (1120, 16)
OPS = {"sort": lambda s: "".join(sorted(s)), "read": lambda s: s}
VISION_CHARS = "0123456789 abcdefghijklmnopqrstuvwxyz"
MARKERS = (BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN)
_FONT_SIZES = (13, 14, 15, 16)  # digit glyphs 8-9 pixels wide, 9-12 tall
CELL = 16  # pixels per digit: one patch


def draw_digits(digits: str, rng: np.random.Generator, size: tuple[int, int] = IMAGE_SIZE) -> np.ndarray:
    """`digits` drawn left to right into a uint8 RGB picture [height, width, 3]: the k-th digit in the
    k-th `CELL` x `CELL` cell from the left edge (one 16-pixel patch each), shifted by up to 1.5 pixels
    either way (never cut by its cell), at a random font size, ink and paper shade, plus pixel noise. Raises ValueError when
    they do not fit."""
    if not digits or not digits.isdigit():
        raise ValueError(f"draw_digits takes a non-empty string of digits, got {digits!r}")
    width, height = size
    if len(digits) * CELL > width or height < CELL:
        raise ValueError(f"{len(digits)} digits do not fit in a {width}x{height} picture ({CELL}x{CELL} pixels "
                         "each); draw fewer or widen it")
    font = ImageFont.load_default(size=int(rng.choice(_FONT_SIZES)))
    _, top, _, bottom = font.getbbox("0123456789")
    left, _, right, _ = font.getbbox("0")
    paper = int(rng.integers(190, 256))
    ink = int(rng.integers(0, 90))
    img = Image.new("L", (width, height), paper)
    draw = ImageDraw.Draw(img)
    y0 = (CELL - (bottom - top)) / 2 - top
    for k, d in enumerate(digits):
        x = k * CELL + (CELL - (right - left)) / 2 - left
        draw.text((x + rng.uniform(-1.5, 1.5), y0 + rng.uniform(-1.5, 1.5)), d, fill=ink, font=font)
    px = np.asarray(img, np.float32) + rng.normal(0, 8, (height, width))
    gray = np.clip(np.rint(px), 0, 255).astype(np.uint8)
    return np.repeat(gray[..., None], 3, axis=-1)


@dataclasses.dataclass(frozen=True)
class ImageDigitTask:
    """One instruction over a picture of `min_len`..`max_len` digits: `op` "sort" (the digits in
    ascending order) or "read" (as written). `kinds`: the digit-string kinds of `tasks.digit_string`
    with their weights (default: uniform random digits)."""

    op: str
    prompt: str
    min_len: int = 4
    max_len: int = 6
    weight: float = 1.0
    kinds: tuple[tuple[str, float], ...] = (("random", 1.0),)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"image task op {self.op!r} is not one of {sorted(OPS)}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"image task lengths must satisfy 1 <= min_len <= max_len, got "
                             f"{self.min_len}..{self.max_len}")
        bad = sorted(set(self.prompt) - set(VISION_CHARS))
        if bad:
            raise ValueError(f"image task prompt {self.prompt!r} has characters {bad} outside {VISION_CHARS!r}")

    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, str, str]:
        """(picture uint8 [H, W, 3], instruction, answer)."""
        names = [k for k, _ in self.kinds]
        p = np.asarray([w for _, w in self.kinds], np.float64)
        kind = names[int(rng.choice(len(names), p=p / p.sum()))]
        digits = digit_string(rng, int(rng.integers(self.min_len, self.max_len + 1)), kind)
        return draw_digits(digits, rng), self.prompt, OPS[self.op](digits)


def tasks_from_config(specs: Sequence[Any]) -> list[ImageDigitTask]:
    """The recipe's `data.image_tasks` list of dicts -> tasks."""
    out = []
    for s in specs:
        d = dict(s)
        if "kinds" in d:
            d["kinds"] = tuple((str(k), float(w)) for k, w in dict(d["kinds"]).items())
        out.append(ImageDigitTask(**d))
    if not out:
        raise ValueError("data.image_tasks is empty: list at least one task")
    return out


def sample_mix(tasks: Sequence[ImageDigitTask], rng: np.random.Generator) -> tuple[np.ndarray, str, str]:
    w = np.asarray([t.weight for t in tasks], np.float64)
    return tasks[int(rng.choice(len(tasks), p=w / w.sum()))].sample(rng)


def heldout_examples(tasks: Sequence[ImageDigitTask], n: int, seed: int) -> list[tuple[np.ndarray, str, str]]:
    """n problems from the mix on the stream default_rng([seed, 99]) (training batches use
    default_rng([data_seed, batch_index]) with data_seed != seed)."""
    rng = np.random.default_rng([int(seed), 99])
    return [sample_mix(tasks, rng) for _ in range(n)]


class ImageTaskSource(Source):
    """Batches of one picture per row: the token layout of `data.collate` (the prompt holds the image's
    soft-token placeholders) plus "pixel_values" float32 [B, P, 3 p^2] and "pixel_positions" int32
    [B, P, 2] from the checkpoint's image processor (`config`; `max_soft_tokens`: its budget, default the
    checkpoint's). Deterministic per batch index."""

    def __init__(self, tasks: Sequence[ImageDigitTask], tokenizer, layout: Layout, batch_size: int, config,
                 max_soft_tokens: int | None = None, seed: int = 0):
        self.tasks, self.tokenizer, self.layout, self.config = list(tasks), tokenizer, layout, config
        self.batch_size, self.seed = batch_size, seed
        self.settings = settings_for(config, max_soft_tokens)

    def problems(self, index: int) -> list[tuple[np.ndarray, str, str]]:
        rng = np.random.default_rng([self.seed, index])
        return [sample_mix(self.tasks, rng) for _ in range(self.batch_size)]

    def examples(self, index: int):
        return self._encode(self.problems(index))[0]

    def _encode(self, problems):
        pre = preprocess_images([image for image, _, _ in problems], self.settings)
        examples = []
        for i, (_, prompt, answer) in enumerate(problems):
            # <bos>, the picture's tokens, the instruction: as `dgemma generate --image` lays it out
            ids = prompt_with_images(self.config, self.tokenizer, prompt, pre.select([i]))[0][0].tolist()
            if len(ids) > self.layout.prompt_length:
                raise ValueError(f"an image prompt is {len(ids)} tokens but data.prompt_length is "
                                 f"{self.layout.prompt_length}: raise prompt_length or lower the soft-token budget")
            examples.append((ids, self.tokenizer.encode(answer)))
        return examples, pre

    def batch(self, index: int) -> dict[str, np.ndarray]:
        examples, pre = self._encode(self.problems(index))
        out = collate(examples, self.layout)
        out["pixel_values"] = pre.pixel_values.astype(np.float32)
        out["pixel_positions"] = pre.position_ids.astype(np.int32)
        return out
