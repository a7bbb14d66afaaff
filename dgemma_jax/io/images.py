"""Images for the Gemma 4 vision tower: loading, preprocessing and the prompt layout (spec: vision.md).

`preprocess_images` gives what transformers' Gemma 4 image processor (`Gemma4ImageProcessorPil`,
transformers 5.23) gives, with numpy and Pillow only (no torch):

1. RGB conversion (below); 2. a bicubic (Pillow) resize, up or down, to the largest size whose sides are
multiples of `pooling_kernel_size * patch_size` and whose pooled token count fits `max_soft_tokens`;
3. pixels scaled to [0, 1] (float32 of `uint8 * (1/255)` computed in float64, as the reference does);
4. row-major `patch x patch` patches, each flattened (row, column, channel); 5. padding to
`max_soft_tokens * pooling_kernel_size**2` patches of zeros at position (-1, -1).
Positions are (x, y) = (patch column, patch row).

RGB conversion follows the reference for each kind of input:
- a file path or bytes: opened with Pillow, EXIF orientation applied, `convert("RGB")` (which drops an
  alpha channel: transparent pixels keep their colour), as transformers' `load_image` does for a path;
- a `PIL.Image`: no EXIF transpose; an image with an alpha band (or a `transparency` colour key, as
  palette GIF/PNGs have) is composited onto white, other modes are `convert("RGB")`-ed;
- a numpy uint8 array `HxWx3` is used as is, `HxWx4` is composited onto white, `HxW`/`HxWx1` is grey.
Modes that are converted: 1, L, LA, La, P, PA, RGB, RGBA, RGBa, RGBX, CMYK (Pillow's plain CMYK->RGB
formula, as the reference), YCbCr. Refused with a ValueError (the reference would convert them by
clipping every value above 255, silently whitening the image): 16-/32-bit integer and float modes
(I, I;16*, F) and other modes (LAB, HSV, ...). Also refused: animated or multi-page images (more than one
frame; the reference silently uses the first; camera MPO JPEGs, whose extra frames are previews, are read
as their primary image like the reference), unreadable or non-image data, empty images, files whose pixel
count exceeds `max_pixels` (default Pillow's decompression-bomb limit), float or non-uint8 arrays,
and a `max_soft_tokens` outside {70, 140, 280, 560, 1120}.

The prompt layout (`expand_image_text`, `expand_image_ids`): each image placeholder `<|image|>`
becomes `<|image>` + `<|image|>` x n + `<image|>` with n the image's soft-token count, and
`mm_token_type_ids` is 1 on the `<|image|>` tokens only (boi/eoi are ordinary text tokens), as
transformers' `Gemma4Processor` does.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from typing import Any, Sequence

import numpy as np

from dgemma_jax.config import SOFT_TOKEN_BUDGETS, read_processor_config
from dgemma_jax.model.masks import image_runs

__all__ = [
    "SOFT_TOKEN_BUDGETS", "IMAGE_TOKEN", "BOI_TOKEN", "EOI_TOKEN", "IMAGE_TOKEN_ID", "BOI_TOKEN_ID",
    "EOI_TOKEN_ID", "ImageSettings", "ImageBatch", "ImageTokenIds", "load_image", "resized_size",
    "soft_token_count", "preprocess_images", "expand_image_text", "expand_image_ids", "mm_token_type_ids",
    "encode_with_images", "settings_for", "prompt_with_images", "image_runs",
]

# The released tokenizer's markers and ids (DiffusionGemmaConfig: image_token_id, boi_token_id, eoi_token_id).
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<|image|>", "<|image>", "<image|>"
IMAGE_TOKEN_ID, BOI_TOKEN_ID, EOI_TOKEN_ID = 258880, 255999, 258882

_CONVERTED_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """The processor's settings; the defaults are the released model's (patch 16, pooling 3, 280 tokens)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280

    def __post_init__(self):
        for name in ("patch_size", "pooling_kernel_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.max_soft_tokens, (int, np.integer)) or self.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens={self.max_soft_tokens!r} is not a Gemma 4 soft-token budget: "
                             f"use one of {SOFT_TOKEN_BUDGETS} (more tokens per image: finer detail, longer prompt)")

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ImageSettings":
        """The settings of a checkpoint's image processor: `processor_config.json` (its "image_processor"
        entry) or `preprocessor_config.json`, in the folder `path` (or that file); the defaults when the
        checkpoint has neither. A processor this module does not reproduce (no resize, another resampling
        filter or scale, a normalisation, no RGB conversion) is a ValueError."""
        found = read_processor_config(path)
        return cls() if found is None else cls._from_processor_dict(*found)

    @classmethod
    def _from_processor_dict(cls, cfg: dict, where: str) -> "ImageSettings":
        unsupported = []
        if not cfg.get("do_resize", True):
            unsupported.append("do_resize=false")
        if cfg.get("resample", 3) != 3:
            unsupported.append(f"resample={cfg['resample']} (only 3, bicubic)")
        if not cfg.get("do_rescale", True) or abs(cfg.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-12:
            unsupported.append(f"do_rescale={cfg.get('do_rescale', True)}, rescale_factor={cfg.get('rescale_factor')}")
        if cfg.get("do_normalize", False) and (any(m != 0 for m in cfg.get("image_mean", [0.0]))
                                               or any(v != 1 for v in cfg.get("image_std", [1.0]))):
            unsupported.append(f"normalisation with mean {cfg.get('image_mean')} and std {cfg.get('image_std')}")
        if not cfg.get("do_convert_rgb", True):
            unsupported.append("do_convert_rgb=false")
        if unsupported:
            raise ValueError(f"{where}: the image processor uses {', '.join(unsupported)}, which "
                             "dgemma_jax.io.images does not reproduce (it implements the Gemma 4 processor: bicubic "
                             "resize, x/255, RGB); preprocess the images yourself and pass pixel_values")
        defaults = cls()
        return cls(patch_size=cfg.get("patch_size", defaults.patch_size),
                   pooling_kernel_size=cfg.get("pooling_kernel_size", defaults.pooling_kernel_size),
                   max_soft_tokens=cfg.get("max_soft_tokens", defaults.max_soft_tokens))

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * 3


@dataclasses.dataclass(frozen=True)
class ImageBatch:
    """Preprocessed images: `pixel_values` float32 [N, max_patches, patch*patch*3] in [0, 1],
    `position_ids` int32 [N, max_patches, 2] as (x, y), (-1, -1) on padding, and the soft-token count
    of each image (the number of `<|image|>` tokens it takes in the prompt)."""

    pixel_values: np.ndarray
    position_ids: np.ndarray
    soft_tokens: tuple[int, ...]
    settings: ImageSettings

    def __len__(self) -> int:
        return len(self.soft_tokens)

    @classmethod
    def concat(cls, batches: Sequence["ImageBatch"]) -> "ImageBatch":
        """The images of `batches` (same settings), in order."""
        return cls(pixel_values=np.concatenate([b.pixel_values for b in batches]),
                   position_ids=np.concatenate([b.position_ids for b in batches]),
                   soft_tokens=tuple(n for b in batches for n in b.soft_tokens), settings=batches[0].settings)

    def select(self, indices: Sequence[int]) -> "ImageBatch | None":
        """The images at `indices`, in that order (None when there are none)."""
        indices = [int(i) for i in indices]
        if not indices:
            return None
        return ImageBatch(pixel_values=self.pixel_values[indices], position_ids=self.position_ids[indices],
                          soft_tokens=tuple(self.soft_tokens[i] for i in indices), settings=self.settings)


# ---------------------------------------------------------------------------------------------
# Loading


def _pil():
    try:  # deferred: Pillow loads only when an image is read, not on every text-only `dgemma` command
        from PIL import Image, ImageOps
    except ImportError as e:  # pragma: no cover - Pillow is a declared dependency
        raise ImportError("images need Pillow: pip install Pillow") from e
    return Image, ImageOps


def _describe(source: Any) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"the {len(source)} given bytes"
    text = repr(os.fspath(source))
    return text if len(text) <= 120 else text[:100] + "...'"


def _open_encoded(source: Any, max_pixels: int | None):
    """A loaded single-frame PIL image from a path or encoded bytes (errors: ValueError)."""
    Image, _ = _pil()
    what = _describe(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ValueError("the image bytes are empty: pass the encoded file's contents (PNG, JPEG, ...)")
        stream = io.BytesIO(bytes(source))
    else:
        path = os.fspath(source)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if path.startswith(("http://", "https://")):
            raise ValueError(f"{what} is a URL: download the image and pass the file's path or bytes")
        if path.startswith("data:"):
            raise ValueError(f"{what} is a data URI: decode it (base64.b64decode of the part after the comma) and "
                             "pass the bytes")
        if not os.path.isfile(path):
            raise ValueError(f"no image file at {what}: check the path" if not os.path.exists(path)
                             else f"{what} is not a file: pass the path of an image file")
        stream = path
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit is checked below
            img = Image.open(stream)
    except Image.DecompressionBombError as e:
        raise ValueError(f"{what} is too large to decode safely ({e}); downscale it first, or raise "
                         "PIL.Image.MAX_IMAGE_PIXELS if you trust the file") from None
    except Image.UnidentifiedImageError:
        raise ValueError(f"{what} is not an image Pillow can read (unknown or damaged format): pass a PNG, "
                         "JPEG, GIF, WebP, BMP or TIFF file") from None
    except OSError as e:
        raise ValueError(f"could not read {what} ({e}): check the file's permissions and contents") from None
    try:
        w, h = img.size
        if max_pixels is not None and w * h > max_pixels:
            raise ValueError(f"{what} is {w}x{h} = {w * h} pixels, more than the limit max_pixels={max_pixels} "
                             "(a guard against decompression bombs): downscale the image first, or pass a larger "
                             "max_pixels if you trust the file")
        _check_frames(img, what)
        try:
            img.load()
        except Exception as e:  # truncated or corrupt data: Pillow raises OSError, SyntaxError, ValueError...
            raise ValueError(f"{what} could not be decoded ({type(e).__name__}: {e}); the file is truncated or "
                             "damaged: re-export or re-download it") from None
    except ValueError:
        img.close()
        raise
    return img


def _check_frames(img, what: str) -> None:
    n = getattr(img, "n_frames", 1)
    if n > 1 and getattr(img, "format", None) != "MPO":  # MPO: a camera JPEG whose extra frames are previews
        raise ValueError(f"{what} is animated ({n} frames); pass one frame as an image: "
                         "img.seek(i); frame = img.convert('RGB')")


def _check_mode(img, what: str) -> None:
    if img.mode not in _CONVERTED_MODES:
        why = ("a 16/32-bit or float image: converting it to 8-bit RGB would clip every value above 255"
               if img.mode.startswith(("I", "F")) else "a mode Gemma's image processor does not convert")
        raise ValueError(f"{what} has mode {img.mode!r}, {why}; convert it to 8-bit RGB yourself (for a 16-bit "
                         "grey image: Image.fromarray((np.asarray(img) >> 8).astype(np.uint8)).convert('RGB'))")
    w, h = img.size
    if w == 0 or h == 0:
        raise ValueError(f"{what} is empty ({w}x{h} pixels): pass an image with at least one pixel")


def _rgb_from_pil(img, what: str) -> np.ndarray:
    """transformers' `convert_to_rgb` on a PIL image: alpha (or a colour key) composited onto white."""
    Image, _ = _pil()
    _check_mode(img, what)
    _check_frames(img, what)
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            img = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            img = img.convert("RGB")
        return np.asarray(img, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as e:
        raise ValueError(f"{what} could not be decoded or converted to RGB ({type(e).__name__}: {e}): "
                         "re-export it as an 8-bit RGB PNG or JPEG") from None


def _rgb_from_array(a: np.ndarray) -> np.ndarray:
    if a.dtype != np.uint8:
        raise ValueError(f"an image array must be uint8 (0..255), got {a.dtype}; e.g. for floats in [0, 1]: "
                         "(x * 255).round().astype(np.uint8)")
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim == 2:
        a = np.repeat(a[..., None], 3, axis=-1)
    if a.ndim != 3 or a.shape[-1] not in (3, 4):
        raise ValueError(f"an image array must be HxWx3 (RGB), HxWx4 (RGBA) or HxW (grey), channels last; got "
                         f"shape {a.shape}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"the image array is empty (shape {a.shape}): pass an image with at least one pixel")
    if a.shape[-1] == 4:  # transformers' convert_to_rgb on arrays: onto white, in float64, rounded
        alpha = a[..., 3:4] / 255
        a = np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return np.ascontiguousarray(a)


_PILLOW_LIMIT: Any = object()   # max_pixels default: Pillow's PIL.Image.MAX_IMAGE_PIXELS


def load_image(image: Any, *, max_pixels: int | None = _PILLOW_LIMIT) -> np.ndarray:
    """An image as a uint8 RGB array [H, W, 3], converted the way transformers' Gemma 4 processor does.

    `image`: a path (str / os.PathLike), encoded bytes, a `PIL.Image.Image` or a uint8 numpy array
    (HxWx3, HxWx4 or HxW). `max_pixels` bounds the pixel count of files and bytes before they are
    decoded (default: Pillow's `PIL.Image.MAX_IMAGE_PIXELS`; None: no bound of ours). Every bad input is
    a ValueError naming the problem and the fix (see the module docstring).
    """
    Image, ImageOps = _pil()
    if max_pixels is _PILLOW_LIMIT:
        max_pixels = Image.MAX_IMAGE_PIXELS
    if isinstance(image, np.ndarray):
        return _rgb_from_array(image)
    if isinstance(image, Image.Image):
        return _rgb_from_pil(image, f"the {image.mode} {image.size[0]}x{image.size[1]} PIL image")
    if isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
        what = _describe(image)
        opened = _open_encoded(image, max_pixels)
        try:
            _check_mode(opened, what)
            try:  # transformers' load_image: EXIF orientation, then a plain RGB conversion
                img = ImageOps.exif_transpose(opened).convert("RGB")
            except (OSError, ValueError, SyntaxError) as e:
                raise ValueError(f"{what} could not be converted to RGB ({type(e).__name__}: {e}): re-export it "
                                 "as an 8-bit RGB PNG or JPEG") from None
            return _rgb_from_pil(img, what)
        finally:
            opened.close()
    raise ValueError(f"cannot read an image from a {type(image).__name__}: pass a file path, encoded bytes, a "
                     "PIL.Image or a uint8 HxWx3 numpy array")


# ---------------------------------------------------------------------------------------------
# Preprocessing


def resized_size(height: int, width: int, settings: ImageSettings = ImageSettings()) -> tuple[int, int]:
    """(height, width) the processor resizes a `height x width` image to: the largest size with both sides
    multiples of `pooling_kernel_size * patch_size` and at most `max_patches` patches, keeping the
    aspect ratio (a side that would round to 0 gets one multiple and the other side `w // h` multiples,
    capped at `max_soft_tokens` multiples), as transformers computes it."""
    if height < 1 or width < 1:
        raise ValueError(f"the image is empty ({width}x{height} pixels): pass an image with at least one pixel")
    p, k = settings.patch_size, settings.pooling_kernel_size
    budget_px = settings.max_patches * p * p
    scale = math.sqrt(budget_px / (height * width))
    step = k * p
    h = int(math.floor(scale * height / step)) * step
    w = int(math.floor(scale * width / step)) * step
    longest = (settings.max_patches // k ** 2) * step
    if h == 0 and w == 0:
        raise ValueError(f"patch_size={p} and pooling_kernel_size={k} leave no room for one {step}x{step} block in "
                         f"{settings.max_soft_tokens} soft tokens: use smaller patches or a larger budget")
    if h == 0:
        h, w = step, min(int(math.floor(width / height)) * step, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * step, longest), step
    if h * w > budget_px:  # not reachable with the released settings; kept as the reference's guard
        raise ValueError(f"resizing {height}x{width} to {h}x{w} exceeds {settings.max_patches} patches of {p}x{p}")
    return h, w


def soft_token_count(height: int, width: int, settings: ImageSettings = ImageSettings()) -> int:
    """How many `<|image|>` tokens a `height x width` image takes in the prompt."""
    h, w = resized_size(height, width, settings)
    return (h // settings.patch_size) * (w // settings.patch_size) // settings.pooling_kernel_size ** 2


def _settings(settings, patch_size, pooling_kernel_size, max_soft_tokens) -> ImageSettings:
    settings = settings or ImageSettings()
    over = {k: v for k, v in dict(patch_size=patch_size, pooling_kernel_size=pooling_kernel_size,
                                  max_soft_tokens=max_soft_tokens).items() if v is not None}
    return dataclasses.replace(settings, **over) if over else settings


def _patches(rgb: np.ndarray, settings: ImageSettings) -> tuple[np.ndarray, np.ndarray, int]:
    Image, _ = _pil()
    p, k = settings.patch_size, settings.pooling_kernel_size
    h, w = resized_size(rgb.shape[0], rgb.shape[1], settings)
    if (h, w) != rgb.shape[:2]:
        rgb = np.asarray(Image.fromarray(rgb).resize((w, h), resample=Image.Resampling.BICUBIC), dtype=np.uint8)
    gh, gw = h // p, w // p
    n = gh * gw
    pixels = np.zeros((settings.max_patches, settings.patch_dim), np.float32)
    scaled = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)
    pixels[:n] = scaled.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(n, settings.patch_dim)
    positions = np.full((settings.max_patches, 2), -1, np.int32)
    ys, xs = np.divmod(np.arange(n, dtype=np.int32), gw)
    positions[:n, 0], positions[:n, 1] = xs, ys
    return pixels, positions, n // k ** 2


def preprocess_images(images: Any, settings: ImageSettings | None = None, *, patch_size: int | None = None,
                      pooling_kernel_size: int | None = None, max_soft_tokens: int | None = None,
                      max_pixels: int | None = _PILLOW_LIMIT) -> ImageBatch:
    """transformers' Gemma 4 image processor on `images` (one image or a list; each as `load_image` takes).

    `settings` (default: the released model's) can be overridden field by field with the keyword
    arguments; `max_soft_tokens` must be one of `SOFT_TOKEN_BUDGETS`.
    """
    settings = _settings(settings, patch_size, pooling_kernel_size, max_soft_tokens)
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ValueError("no images given: pass one image or a non-empty list of images")
    out = [_patches(load_image(im, max_pixels=max_pixels), settings) for im in images]
    return ImageBatch(pixel_values=np.stack([o[0] for o in out]), position_ids=np.stack([o[1] for o in out]),
                      soft_tokens=tuple(int(o[2]) for o in out), settings=settings)


# ---------------------------------------------------------------------------------------------
# Prompt layout


@dataclasses.dataclass(frozen=True)
class ImageTokenIds:
    """The ids of `<|image|>` (the placeholder, repeated once per soft token), `<|image>` and `<image|>`;
    the defaults are the released tokenizer's."""

    image: int = IMAGE_TOKEN_ID
    boi: int = BOI_TOKEN_ID
    eoi: int = EOI_TOKEN_ID

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ImageTokenIds":
        """The ids a tokenizer (`dgemma_jax.io.tokenizer.Tokenizer`) gives the three markers."""
        ids = {}
        for field, piece in (("image", IMAGE_TOKEN), ("boi", BOI_TOKEN), ("eoi", EOI_TOKEN)):
            i = tokenizer.piece_to_id(piece)
            if i is None:
                raise ValueError(f"the tokenizer has no {piece!r} token, so it cannot lay out images: use the "
                                 "Gemma 4 tokenizer of the checkpoint")
            ids[field] = int(i)
        return cls(**ids)


def _counts(soft_tokens: Any) -> list[int]:
    if isinstance(soft_tokens, ImageBatch):
        return list(soft_tokens.soft_tokens)
    counts = [int(n) for n in soft_tokens]
    if any(n < 1 for n in counts):
        raise ValueError(f"soft-token counts must be positive, got {counts}")
    return counts


def _mismatch(found: int, counts: list[int]) -> ValueError:
    return ValueError(f"the prompt has {found} image placeholder(s) {IMAGE_TOKEN!r} but {len(counts)} image(s) were "
                      f"given: put one {IMAGE_TOKEN} where each image goes (the chat renderer writes one per image "
                      "part), in the images' order")


def expand_image_text(text: str, soft_tokens: Any) -> str:
    """`text` with its i-th `<|image|>` replaced by `<|image>` + `<|image|>` x soft_tokens[i] + `<image|>`.

    `soft_tokens`: counts (one per image) or an `ImageBatch`. The number of placeholders must equal the
    number of images."""
    counts = _counts(soft_tokens)
    pieces = text.split(IMAGE_TOKEN)
    if len(pieces) - 1 != len(counts):
        raise _mismatch(len(pieces) - 1, counts)
    out = [pieces[0]]
    for n, rest in zip(counts, pieces[1:]):
        out += [BOI_TOKEN, IMAGE_TOKEN * n, EOI_TOKEN, rest]
    return "".join(out)


def mm_token_type_ids(ids: Any, image_token_id: int = IMAGE_TOKEN_ID) -> np.ndarray:
    """int32 [..., T]: 1 where `ids` is the image token, 0 elsewhere (boi/eoi included)."""
    return (np.asarray(ids) == image_token_id).astype(np.int32)


def expand_image_ids(ids: Sequence[int], soft_tokens: Any,
                     token_ids: ImageTokenIds = ImageTokenIds()) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mm_token_type_ids), both int32 [T']: each image placeholder id in the 1-D `ids` (one per image,
    e.g. from encoding `render_chat` output) expanded to boi + image x n + eoi, as `expand_image_text`
    followed by encoding gives."""
    counts = _counts(soft_tokens)
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"ids must be one 1-D sequence, got shape {ids.shape}: expand each row separately")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    where = np.flatnonzero(ids == token_ids.image)
    if len(where) != len(counts):
        raise _mismatch(len(where), counts)
    if any(i + 1 < len(ids) and ids[i + 1] == token_ids.image for i in where) or np.isin(
            ids, [token_ids.boi, token_ids.eoi]).any():
        raise ValueError("the ids already contain an expanded image (boi/eoi markers or consecutive image tokens): "
                         "pass ids with one placeholder per image")
    parts, start = [], 0
    for i, n in zip(where, counts):
        parts += [ids[start:i], [token_ids.boi], np.full(n, token_ids.image), [token_ids.eoi]]
        start = i + 1
    parts.append(ids[start:])
    out = np.concatenate([np.asarray(p, np.int64) for p in parts]).astype(np.int32)
    return out, mm_token_type_ids(out, token_ids.image)


def encode_with_images(tokenizer, text: str, images: Any = (), settings: ImageSettings | None = None, *,
                       add_bos: bool = False, **overrides) -> dict[str, Any]:
    """Encode a prompt with `<|image|>` placeholders and its images, the way transformers' Gemma 4
    processor does: {"input_ids": int32 [T], "mm_token_type_ids": int32 [T], "images": ImageBatch | None}.
    `overrides` are `preprocess_images`' keyword arguments (patch_size, max_soft_tokens, ...)."""
    token_ids = ImageTokenIds.from_tokenizer(tokenizer)
    if isinstance(images, ImageBatch):
        batch = images
    elif isinstance(images, (list, tuple)) and len(images) == 0:
        batch = None
    else:
        batch = preprocess_images(images, settings, **overrides)
    counts = list(batch.soft_tokens) if batch is not None else []
    ids = np.asarray(tokenizer.encode(expand_image_text(text, counts), add_bos=add_bos), np.int32)
    return {"input_ids": ids, "mm_token_type_ids": mm_token_type_ids(ids, token_ids.image), "images": batch}


# ---------------------------------------------------------------------------------------------
# For a checkpoint


def settings_for(config, max_soft_tokens: int | None = None) -> ImageSettings:
    """The image preprocessing a checkpoint's vision tower takes (its patch size and pooling);
    max_soft_tokens: the per-image budget (default: the checkpoint's, `VisionConfig.default_soft_tokens`)."""
    v = config.vision
    if v is None:
        raise ValueError(f"{config.name} is a text-only checkpoint (no vision tower): it cannot take images. "
                         "Load a checkpoint with vision weights or drop the images")
    budget = v.default_soft_tokens if max_soft_tokens is None else int(max_soft_tokens)
    return ImageSettings(patch_size=v.patch_size, pooling_kernel_size=v.pooling_kernel_size, max_soft_tokens=budget)


def prompt_with_images(config, tokenizer, text: str, images, max_soft_tokens: int | None = None,
                       add_bos: bool = True):
    """One prompt with images -> (tokens [1, T], lengths [1], ImageBatch) for `Engine.generate`.

    Each `<|image|>` in `text` marks where an image goes (the chat renderer writes one per image part);
    a text without any gets one per image at its start. images: one or a list (paths, bytes, PIL
    images or uint8 arrays, `load_image`), or an `ImageBatch` already preprocessed for this
    checkpoint. config: the checkpoint's `ModelConfig`."""
    settings = settings_for(config, max_soft_tokens)
    if not isinstance(images, ImageBatch):
        images = list(images) if isinstance(images, (list, tuple)) else [images]
    if IMAGE_TOKEN not in text:
        text = IMAGE_TOKEN * len(images) + text
    enc = encode_with_images(tokenizer, text, images, settings, add_bos=add_bos)
    ids = enc["input_ids"]
    return ids[None].astype(np.int32), np.array([len(ids)], np.int32), enc["images"]
