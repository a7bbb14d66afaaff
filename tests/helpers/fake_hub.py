"""A local stand-in for the Hugging Face Hub's HTTP API, so that huggingface_hub's own clients
(`snapshot_download`, `hf_hub_download`, the `hf://` fsspec filesystem `HfFileSystem`) run unchanged,
without network or account.

It serves model repos from local directories, each at one commit, and answers what those clients ask:
`GET /api/models/REPO[/revision/REV]` (repo info, with its files), `GET /api/models/REPO/tree/REV[/PATH]`,
`POST /api/models/REPO/paths-info/REV`, and `GET`/`HEAD /REPO/resolve/REV/PATH` with HTTP ranges.
Anything else is a 404 that the test sees. Every byte of file content it sends is counted per client:
a client points at `http://HOST:PORT/<client>` (HF_ENDPOINT), so that two processes sharing the server
are told apart by the first path segment.

    with fake_hub({"my-org/tiny": "/path/to/checkpoint"}) as hub:
        env = {"HF_ENDPOINT": hub.endpoint("p0"), "HF_HUB_CACHE": ...}
        ... hub.sent["p0"] ...   # file bytes sent to that client
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import threading
import time
from collections import defaultdict
from urllib.parse import unquote

_REVISION = re.compile(r"^api/models/([^/]+/[^/]+)(?:/revision/(.+))?$")
_TREE = re.compile(r"^api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
_PATHS = re.compile(r"^api/models/([^/]+/[^/]+)/paths-info/([^/]+)$")
_RESOLVE = re.compile(r"^([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class FakeHub:
    def __init__(self, repos: dict[str, str]):
        self.repos = {name: os.path.abspath(path) for name, path in repos.items()}
        self.sha = {name: hashlib.sha1(name.encode()).hexdigest() for name in repos}
        self.sent: dict[str, int] = defaultdict(int)
        self.requests: list[tuple[str, str, str]] = []  # (client, method, path)
        self.port = None

    def endpoint(self, client: str = "c0") -> str:
        return f"http://127.0.0.1:{self.port}/{client}"

    # ------------------------------------------------------------------ the repo's contents
    def _commit(self, repo: str, rev: str) -> str | None:
        rev = unquote(rev)
        return self.sha[repo] if repo in self.repos and rev in ("main", self.sha[repo]) else None

    def _files(self, repo: str) -> list[str]:
        root = self.repos[repo]
        return sorted(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                      for d, _, fs in os.walk(root) for f in fs)

    def _entry(self, repo: str, rel: str) -> dict:
        full = os.path.join(self.repos[repo], rel)
        if os.path.isdir(full):
            return {"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "path": rel}
        size = os.path.getsize(full)
        oid = hashlib.sha1(f"{rel}:{size}".encode()).hexdigest()
        entry = {"type": "file", "oid": oid, "size": size, "path": rel}
        if rel.endswith(".safetensors"):  # stored in LFS on the real Hub
            entry["lfs"] = {"oid": hashlib.sha256(rel.encode()).hexdigest(), "size": size, "pointerSize": 134}
        return entry

    # ------------------------------------------------------------------ the HTTP API
    async def __call__(self, scope, receive, send):
        from fastapi import Request  # starlette's, which fastapi re-exports
        from fastapi.responses import JSONResponse

        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        client, _, path = request.url.path.lstrip("/").partition("/")
        self.requests.append((client, request.method, path))
        response = None
        if m := _REVISION.match(path):
            repo, rev = m.group(1), m.group(2) or "main"
            sha = self._commit(repo, rev)
            if repo not in self.repos:
                response = _error(404, "RepoNotFound", f"Repository {repo} not found")
            elif sha is None:
                response = _error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            else:
                response = JSONResponse({"id": repo, "modelId": repo, "sha": sha, "private": False,
                                         "siblings": [{"rfilename": f} for f in self._files(repo)]})
        elif m := _TREE.match(path):
            repo, rev, sub = m.group(1), m.group(2), unquote(m.group(3) or "").strip("/")
            if self._commit(repo, rev) is None:
                response = _error(404, "RepoNotFound", "not found")
            else:
                base = os.path.join(self.repos[repo], sub)
                if not os.path.isdir(base):
                    response = _error(404, "EntryNotFound", f"{sub} does not exist")
                else:
                    names = sorted(os.listdir(base))
                    response = JSONResponse([self._entry(repo, f"{sub}/{n}".lstrip("/")) for n in names])
        elif m := _PATHS.match(path):
            repo, rev = m.groups()
            if self._commit(repo, rev) is None:
                response = _error(404, "RepoNotFound", "not found")
            else:
                form = await request.form()
                paths = form.getlist("paths")
                response = JSONResponse([self._entry(repo, p) for p in paths
                                         if os.path.exists(os.path.join(self.repos[repo], p))])
        elif m := _RESOLVE.match(path):
            repo, rev, rel = m.group(1), m.group(2), unquote(m.group(3))
            sha = self._commit(repo, rev)
            full = os.path.join(self.repos.get(repo, "/nonexistent"), rel)
            if sha is None or not os.path.isfile(full):
                response = _error(404, "EntryNotFound", f"{rel} not found")
            else:
                response = self._file(client, request, repo, sha, rel, full)
        if response is None:
            response = _error(404, "NotFound", f"the fake Hub does not answer {request.method} /{path}")
        await response(scope, receive, send)

    def _file(self, client, request, repo, sha, rel, full):
        from fastapi.responses import Response

        size = os.path.getsize(full)
        entry = self._entry(repo, rel)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        headers = {"x-repo-commit": sha, "etag": f'"{etag}"', "accept-ranges": "bytes"}
        if "lfs" in entry:
            headers["x-linked-etag"] = f'"{etag}"'
            headers["x-linked-size"] = str(size)
        start, end, status = 0, size, 200
        if rng := request.headers.get("range"):
            m = _RANGE.match(rng.strip())
            if not m:
                return _error(416, "RangeNotSatisfiable", rng)
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            status = 206
            headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
        if request.method == "HEAD":
            headers["content-length"] = str(end - start)
            return Response(status_code=status, headers=headers)
        with open(full, "rb") as f:
            f.seek(start)
            body = f.read(end - start)
        self.sent[client] += len(body)
        return Response(body, status_code=status, headers=headers, media_type="application/octet-stream")


def _error(status: int, code: str, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status, headers={"x-error-code": code,
                                                                         "x-error-message": message})


@contextlib.contextmanager
def fake_hub(repos: dict[str, str]):
    """A FakeHub serving `repos` ({"org/name": directory}) on a free local port, in a thread."""
    import uvicorn

    hub = FakeHub(repos)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    hub.port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(hub, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake Hub did not start")
        time.sleep(0.02)
    try:
        yield hub
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
