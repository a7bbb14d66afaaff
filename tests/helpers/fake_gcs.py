"""A local stand-in for Google Cloud Storage, for gs:// work directories without credentials or network.

Both clients that a gs:// training run uses talk to it over HTTP: gcsfs (etils.epath's gs:// backend:
the run's metrics, config, plots, orbax's metadata and step directories) and tensorstore's `gcs` driver
(orbax's array data). It is gcp-storage-emulator (in memory) with what tensorstore relies on added: the
object's generation as `x-goog-generation` on downloads, and the `ifGenerationMatch` /
`ifGenerationNotMatch` preconditions (412 / 304) on downloads, uploads and deletes.

    with fake_gcs("bkt") as env:      # env: the variables that point gcsfs, google-cloud-storage and
        subprocess.run(..., env={**os.environ, **env})   # tensorstore at the server
        ... "gs://bkt/run" ...

`python -m tests.helpers.fake_gcs PORT BUCKET` runs the server alone (what `fake_gcs` starts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from http import HTTPStatus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generation(storage, request) -> str:
    """The object's current generation ("0": absent, as GCS preconditions count it)."""
    from gcp_storage_emulator.exceptions import NotFound

    bucket = request.params["bucket_name"]
    name = request.params.get("object_id") or (request.query.get("name") or [None])[0]
    if name is None:
        return "0"
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"


def _failed(request, storage, response) -> bool:
    """Answer 412 (or 304) when the request's generation precondition does not hold."""
    gen = _generation(storage, request)
    match = request.query.get("ifGenerationMatch")
    if match and match[0] != gen:
        response.status = HTTPStatus.PRECONDITION_FAILED
        return True
    not_match = request.query.get("ifGenerationNotMatch")
    if not_match and not_match[0] == gen:
        response.status = HTTPStatus.NOT_MODIFIED
        return True
    return False


def _patched():
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    plain = {"download": objects.download, "insert": objects.insert, "delete": objects.delete}

    def download(request, response, storage, *args, **kwargs):
        if _failed(request, storage, response):
            return
        plain["download"](request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            response["x-goog-generation"] = _generation(storage, request)
            response["x-goog-metageneration"] = "1"

    def insert(request, response, storage, *args, **kwargs):
        if request.query.get("ifGenerationMatch") and _failed(request, storage, response):
            return
        plain["insert"](request, response, storage, *args, **kwargs)

    def delete(request, response, storage, *args, **kwargs):
        if _failed(request, storage, response):
            return
        plain["delete"](request, response, storage, *args, **kwargs)

    new = {plain["download"]: download, plain["insert"]: insert, plain["delete"]: delete}
    objects.download = download  # objects.get calls it for ?alt=media
    for _, handlers in server.HANDLERS:
        for method, fn in list(handlers.items()):
            handlers[method] = new.get(fn, fn)
    return server


def serve(port: int, bucket: str) -> None:
    logging.disable(logging.CRITICAL)
    server = _patched()
    srv = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    srv.start()
    srv._api._httpd.handle_error = lambda *a: None  # a client that hangs up early is not news
    while True:
        time.sleep(3600)


def client_env(port: int) -> dict[str, str]:
    url = f"http://127.0.0.1:{port}"
    return {"STORAGE_EMULATOR_HOST": url,             # gcsfs and google-cloud-storage
            "TENSORSTORE_GCS_HTTP_URL": url,          # tensorstore's gcs driver (orbax's arrays)
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",  # tensorstore: no credential search
            "GOOGLE_CLOUD_PROJECT": "test"}


@contextlib.contextmanager
def fake_gcs(bucket: str = "bkt"):
    """Start the server (a subprocess) with `bucket`; yields the client environment (client_env)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.fake_gcs", str(port), bucket], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b/{bucket}", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.time() < deadline, "the fake GCS server did not start"
                time.sleep(0.1)
        yield client_env(port)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
