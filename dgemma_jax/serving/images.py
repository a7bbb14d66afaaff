"""OpenAI-style image parts of chat messages -> the chat renderer's image parts.

A client sends `{"type": "image_url", "image_url": {"url": ...}}` where the url is
- a data URL, `data:image/png;base64,...` (any `image/*` media type Pillow can decode): decoded here;
- a local file, `file:///abs/path` or a plain path: only inside a directory the operator allowed
  (`dgemma serve --allowed-image-dir DIR`, repeatable; none by default), resolved through symlinks
  and `..` before the check;
- an http(s) URL: refused (the server fetches nothing).
Each becomes `{"type": "image", "image": <bytes>}` or `{"type": "image", "path": <path>}` for
`dgemma_jax.io.chat.render_chat` / `chat_images`. Every problem is a `ValueError` whose message is the
client's HTTP 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import os
import urllib.parse
import warnings
from typing import Sequence

MAX_IMAGE_BYTES = 32 * 2 ** 20   # the largest encoded image a request may carry (data URL or file)

DECODE_PIXELS = 100_000_000   # pixels decoded at once across requests (dgemma serve --max-decode-pixels)

__all__ = ["MAX_IMAGE_BYTES", "DECODE_PIXELS", "resolve_image_parts", "has_image_parts", "sizes", "PixelBudget"]


def has_image_parts(messages: Sequence[dict]) -> bool:
    return any(isinstance(p, dict) and p.get("type") in ("image_url", "image")
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def _data_url(url: str, where: str) -> bytes:
    head, sep, data = url.partition(",")
    if not sep:
        raise ValueError(f"{where}: a data URL needs a comma before its data (data:image/png;base64,...)")
    meta = head[len("data:"):].split(";")
    media = meta[0].strip().lower()
    if not media.startswith("image/"):
        raise ValueError(f"{where}: the data URL's media type is {media or 'missing'!r}; send an image "
                         "(data:image/png;base64,..., also image/jpeg, image/webp, image/gif, ...)")
    if "base64" not in [m.strip().lower() for m in meta[1:]]:
        raise ValueError(f"{where}: the data URL is not base64-encoded; send data:{media};base64,<the file's bytes "
                         "in base64>")
    data = "".join(data.split())
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{where}: the image is larger than this server's limit of {MAX_IMAGE_BYTES} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: the data URL's base64 is invalid ({e})") from None
    if not raw:
        raise ValueError(f"{where}: the data URL holds no data")
    return raw


def _local_path(url: str, allowed_dirs: Sequence[str], where: str) -> str:
    if url.startswith("file:"):
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{where}: file URLs must name a local file (file:///path), not host {parsed.netloc!r}")
        path = urllib.parse.unquote(parsed.path)
    else:
        path = url
    if not allowed_dirs:
        raise ValueError(f"{where}: this server reads no local image files; send the image as a data URL "
                         "(data:image/png;base64,...), or start the server with --allowed-image-dir DIR to "
                         "allow files under DIR")
    if not os.path.isabs(path):
        raise ValueError(f"{where}: a local image path must be absolute; got {path!r}")
    real = os.path.realpath(path)
    for d in allowed_dirs:
        root = os.path.realpath(d)
        if os.path.commonpath([real, root]) == root:
            break
    else:
        raise ValueError(f"{where}: {path!r} is outside the directories this server reads images from "
                         "(the operator's --allowed-image-dir)")
    if not os.path.isfile(real):
        raise ValueError(f"{where}: no image file at {path!r}")
    if os.path.getsize(real) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image file is larger than this server's limit of {MAX_IMAGE_BYTES} bytes")
    return real


def _resolve(part: dict, allowed_dirs: Sequence[str], where: str) -> dict:
    spec = part.get("image_url")
    if isinstance(spec, str):
        url = spec
    elif isinstance(spec, dict) and isinstance(spec.get("url"), str):
        url = spec["url"]
    else:
        raise ValueError(f"{where}: an image_url part needs {{\"image_url\": {{\"url\": \"data:image/...\"}}}}")
    url = url.strip()
    if not url:
        raise ValueError(f"{where}: the image URL is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return {"type": "image", "image": _data_url(url, where)}
    if scheme in ("http", "https", "ftp"):
        raise ValueError(f"{where}: this server does not fetch URLs ({scheme}://...); send the image as a data URL "
                         "(data:image/png;base64,...)")
    if scheme not in ("", "file"):
        raise ValueError(f"{where}: unsupported image URL scheme {scheme!r}; send a data URL "
                         "(data:image/png;base64,...)")
    return {"type": "image", "path": _local_path(url, allowed_dirs, where)}


def resolve_image_parts(messages: list[dict], allowed_dirs: Sequence[str] = ()) -> list[dict]:
    """`messages` with each `image_url` part replaced by a renderer image part (see the module doc).
    A raw `{"type": "image"}` part (the library's form, which may name any path) is refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "image_url":
                parts.append(_resolve(p, allowed_dirs, where))
            elif kind == "image":
                raise ValueError(f"{where}: send images as {{\"type\": \"image_url\", \"image_url\": {{\"url\": "
                                 "\"data:image/png;base64,...\"}}} parts")
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return out


def sizes(messages: Sequence[dict]) -> list[tuple[int, int]]:
    """(height, width) of each resolved image part of `messages`, read from its header (Pillow opens
    a file lazily: nothing is decoded); an unreadable image is left out (its decode answers the 400)."""
    from PIL import Image   # deferred: only image requests need it

    out = []
    for m in messages:
        for p in m.get("content") if isinstance(m.get("content"), list) else ():
            if not (isinstance(p, dict) and p.get("type") == "image"):
                continue
            source = io.BytesIO(p["image"]) if "image" in p else p.get("path")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with Image.open(source) as img:
                        w, h = img.size
                out.append((h, w))
            except Exception:  # noqa: BLE001 - the decoder's own checks name the problem
                pass
    return out


class PixelBudget:
    """The pixels being decoded at once across requests: a request whose images would pass `limit`
    waits (on the event loop) until others finish; one larger than the whole budget runs alone."""

    def __init__(self, limit: int = DECODE_PIXELS):
        self.limit, self.used = int(limit), 0
        self._cond: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def hold(self, n: int):
        n = min(int(n), self.limit)
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            async with self._cond:
                self.used -= n
                self._cond.notify_all()
