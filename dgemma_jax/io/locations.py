"""Where a checkpoint lives -> a local directory the loaders read. Every entry point (the `dgemma`
commands, `DiffusionGemma.from_pretrained`, `load_hf`, `convert`, the trainer's init) goes through
`resolve` (or `locate`, which leaves the weights in the store); nothing else knows about URLs or the Hub.

    resolve("/data/ckpt")                                 # a local directory: returned as it is
    resolve("gs://my-bucket/diffusiongemma")              # any fsspec URL (gs://, s3://, memory://): mirrored
    resolve("google/diffusiongemma-26B-A4B-it")           # a Hugging Face Hub repo id: snapshot_download
    resolve("google/diffusiongemma-26B-A4B-it@v1.0")      # pinned to a revision (branch, tag, commit)
    resolve("hf://google/diffusiongemma-26B-A4B-it", revision="abc123")  # hf:// says "the Hub" explicitly

Both checkpoint formats (ours: dgemma_model.json + an orbax params/ tree; Hugging Face:
config.json + *.safetensors + tokenizer files) come from every kind of location.

The model loaders go through `locate`: the *.safetensors weights of a Hugging Face checkpoint at a URL
stay in the store, and each process reads only the byte ranges of its own shards from there
(`io.hf.SafetensorsDir`); the other files, and with mirror=True (`--mirror`) the weights too, take
the path below.

Remote URLs are copied file by file through fsspec (gs:// needs gcsfs: the [gcs] extra, part of [tpu])
into a local mirror, ``$DGEMMA_CACHE/checkpoints/<protocol>/<path>`` (DGEMMA_CACHE defaults to
``$XDG_CACHE_HOME/dgemma_jax``, i.e. ``~/.cache/dgemma_jax``). A manifest in the mirror records each
file's size and version stamp (etag / md5 / generation / mtime, whatever the store reports); a later
`resolve` of the same URL lists the remote directory again and copies only the files that changed,
so the second run starts without a copy. Each file is written to a temporary name and renamed when
complete: an interrupted copy is never taken for a whole file.

Hub repos are downloaded into the Hugging Face cache (HF_HOME / HF_HUB_CACHE, ~/.cache/huggingface)
with only the files a checkpoint needs; a run of several processes (a pod) downloads all but the
weights, which each process reads in ranges from the Hub (`locate`). Offline (HF_HUB_OFFLINE=1, or
no network) a repo already in the cache is used as it is. Failures are one-line errors that name the fix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import sys

from dgemma_jax.config import ModelConfig
from dgemma_jax.io.formats import META, detect_format
from dgemma_jax.paths import cache_root

# files a checkpoint needs, as huggingface_hub allow_patterns (fnmatch: "*" also matches "/")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "params/*"]
# any directory (check=False: a gemma-library orbax tree for `dgemma convert`): all but other frameworks' weights
HUB_IGNORED = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.tflite"]
# the files that describe a checkpoint without its weights (`dgemma inspect`)
CONFIG_FILES = ("dgemma_model.json", "config.json", "generation_config.json")
MANIFEST = ".dgemma_mirror.json"

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointNotFound(FileNotFoundError):
    """A checkpoint location that cannot be read: missing, unreachable, not allowed, or not downloaded."""


def cache_dir() -> str:
    """Where remote checkpoints are mirrored: the project's cache directory (`paths.cache_root`:
    $DGEMMA_CACHE, else $XDG_CACHE_HOME/dgemma_jax, else ~/.cache/dgemma_jax), under <it>/checkpoints."""
    return cache_root()


def split_revision(location: str, revision: str | None = None) -> tuple[str, str | None]:
    """"org/name@rev" -> ("org/name", "rev"); a --revision as well must agree with it."""
    base, at, rev = location.partition("@")
    if not at:
        return location, revision
    if not rev:
        raise ValueError(f"{location!r} ends with '@' but names no revision; write REPO@REVISION")
    if revision is not None and revision != rev:
        raise ValueError(f"{location!r} pins revision {rev!r} but --revision is {revision!r}; give it once")
    return base, rev


def kind(location: str | os.PathLike) -> str:
    """'local', 'url' (an fsspec URL) or 'hub' (a Hugging Face Hub repo id)."""
    loc = os.fspath(location)
    if loc.startswith("hf://"):
        return "hub"
    if "://" in loc and not loc.startswith("file://"):
        return "url"
    if loc.startswith("file://") or os.path.exists(loc):
        return "local"
    base = loc.partition("@")[0]
    # a missing relative path "a/b" is read as a Hub repo id; "./a/b", "/a/b", "a/b/c" stay local
    return "hub" if _REPO_ID.match(base) and ".." not in base and "--" not in base else "local"


def orbax_path(location: str | os.PathLike, what: str = "checkpoint directory") -> str:
    """A directory that orbax writes to (or reads in place) as orbax takes it: a gs:// URL unchanged,
    a local path made absolute. orbax (tensorstore's gcs driver beside etils.epath) writes gs:// and
    local paths only: any other URL is a ValueError naming `what`."""
    loc = os.fspath(location)
    if loc.startswith("file://"):
        loc = loc[len("file://"):]
    if "://" not in loc:
        return os.path.abspath(loc)
    if loc.startswith("gs://") and len(loc) > len("gs://"):
        return loc.rstrip("/")
    raise ValueError(f"{what} {loc!r}: orbax writes to a local directory or a gs:// URL only; "
                     "use one of those (gs:// needs gcsfs: the [gcs] extra, part of [tpu])")


def resolve(location: str | os.PathLike, revision: str | None = None, *, files: str = "all",
            check: bool = True, progress: bool = True) -> str:
    """A local directory holding the checkpoint at `location` (see the module docstring).

    files: "all", "config" (only CONFIG_FILES: enough for `dgemma inspect`) or "no-weights" (all but the
    *.safetensors files, which `locate` leaves in the store).
    check: the location must hold a checkpoint of either format (one-line ValueError otherwise; a
    remote directory is checked from its listing, before anything is copied). False: any directory
    (a gemma-library orbax tree for `dgemma convert`, a bare params/ tree for the trainer).
    A local path is returned unchanged (missing or not, so that the loaders' own errors stay as they are)."""
    loc = os.fspath(location)
    k = kind(loc)
    if k == "local":
        if revision is not None:
            raise ValueError(f"--revision applies to Hugging Face Hub repo ids, not to the local path {loc!r}")
        return loc[len("file://"):] if loc.startswith("file://") else loc
    if k == "url":
        if revision is not None:
            raise ValueError(f"--revision applies to Hugging Face Hub repo ids, not to the URL {loc!r}")
        return mirror(loc, files=files, check=check, progress=progress)
    repo, rev = split_revision(loc.removeprefix("hf://"), revision)
    return hub_snapshot(repo, rev, files=files, check=check, explicit=loc.startswith("hf://"))


def locate(location: str | os.PathLike, revision: str | None = None, *, mirror: bool | None = None,
           progress: bool = True) -> tuple[str, str | None]:
    """(a local directory of the checkpoint's files, the fsspec URL its *.safetensors are read from or None).

    Where the weights are read from (`io.hf.SafetensorsDir` reads only the byte ranges of each process's
    own shards from a URL):
    - a local directory: in place;
    - an fsspec URL (gs://, ...): straight from the store; mirror=True copies them into the local
      mirror first (later starts then skip the store);
    - a Hub repo: mirror=None (default) downloads them into the Hugging Face cache when this is the only
      process (it reads every byte anyway, and later starts read the cache), and reads each process's
      shards straight from the Hub (`hf://REPO@COMMIT`) when there are several (a pod: no host copies
      the whole model); mirror=True / False force the download / the direct reads.
    The other files (config, tokenizer, the safetensors index) are copied locally either way. A Hub
    revision is pinned to its commit first, so that every process reads the same one. A checkpoint in
    our format at gs:// is restored by orbax straight from the bucket (the returned URL: the directory
    holding its params/), each process its own shards; at another URL it is copied whole."""
    k = kind(location)
    if k == "local" or mirror:
        return resolve(location, revision, progress=progress), None
    if k == "hub":
        import jax  # deferred: only a Hub repo asks how many processes read it

        if (mirror is None and jax.process_count() == 1) or _hub_offline():
            return resolve(location, revision, progress=progress), None
        loc = os.fspath(location)
        repo, rev = split_revision(loc.removeprefix("hf://"), revision)
        commit = hub_commit(repo, rev, explicit=loc.startswith("hf://"))
        local = hub_snapshot(repo, commit, files="no-weights", explicit=loc.startswith("hf://"))
        return local, (f"hf://{repo}@{commit}" if detect_format(local, need_weights=False) == "hf" else None)
    local = resolve(location, revision, files="no-weights", progress=progress)
    fmt = detect_format(local, need_weights=False)
    if fmt == "hf" or (fmt == "dgemma" and orbax_reads(os.fspath(location))):
        return local, os.fspath(location)
    return resolve(location, revision, progress=progress), None  # ours elsewhere: its params/ copied too


def orbax_reads(url: str) -> bool:
    """Whether orbax restores a checkpoint straight from this URL (tensorstore's gcs driver: gs:// only)."""
    return url.startswith("gs://")


# ---------------------------------------------------------------------------- fsspec URLs
def mirror_path(url: str) -> str:
    """The local mirror of a remote URL: <cache_dir>/checkpoints/<protocol>/<path>."""
    protocol, _, rest = url.partition("://")
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")]
    return os.path.join(cache_dir(), "checkpoints", re.sub(r"[^\w.-]", "_", protocol), *parts)


def _stamp(info: dict) -> list:
    version = next((info[k] for k in ("generation", "md5Hash", "ETag", "etag", "mtime", "LastModified", "updated",
                                      "created") if info.get(k) is not None), None)
    return [info.get("size"), str(version) if version is not None else None]


def open_fs(url: str):
    """(fsspec filesystem, path in it) of a URL; a missing protocol package or an unknown protocol is a
    one-line CheckpointNotFound."""
    import fsspec  # deferred: ~90 ms to import, and only remote URLs (gs://, s3://, ...) need it

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # the protocol's package (gcsfs, s3fs, ...) is not installed
        fix = " (pip install 'dgemma_jax[gcs]')" if url.startswith(("gs://", "gcs://")) else ""
        raise CheckpointNotFound(f"cannot read {url!r}: {e}{fix}".replace("\n", " ")) from None
    except ValueError as e:  # an unknown protocol
        raise CheckpointNotFound(f"cannot read {url!r}: {e}") from None


def remote_error(url: str, e: Exception) -> CheckpointNotFound:
    """A store's failure (auth, network: each store's own exception types) as one line naming the fix."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    hint = ("sign in to the store (for gs://: gcloud auth application-default login, or a VM service account "
            "with read access to the bucket)" if isinstance(e, PermissionError) or "401" in first or "403" in first
            else "check the URL and the network")
    return CheckpointNotFound(f"cannot read checkpoint {url!r} ({type(e).__name__}: {first}); {hint}")


def _check_listing(url: str, rels: set[str], need_weights: bool) -> None:
    """The checks of `formats.detect_format`, on the remote listing (nothing copied yet)."""
    top = {r for r in rels if "/" not in r}
    if META in top:
        return
    if "config.json" in top:
        if need_weights and not any(r.endswith(".safetensors") for r in top):
            raise ValueError(f"{url!r} has a config.json but no *.safetensors weights")
        return
    raise ValueError(f"{url!r} is not a checkpoint: expected {META} (dgemma_jax) or config.json + *.safetensors "
                     "(Hugging Face)")


@contextlib.contextmanager
def _quiet_store_logs():
    """The stores' own retry logs (gcsfs logs each failed attempt with a traceback) stay quiet: a
    failure ends as one error naming its cause. A level the user set on those loggers is kept."""
    loggers = [logging.getLogger(n) for n in ("gcsfs", "s3fs", "fsspec")]
    unset = [lg for lg in loggers if lg.level == logging.NOTSET]
    for lg in unset:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg in unset:
            lg.setLevel(logging.NOTSET)


def mirror(url: str, files: str = "all", check: bool = True, progress: bool = True) -> str:
    """Copy the directory at an fsspec URL into its local mirror (changed files only) -> the mirror."""
    with _quiet_store_logs():
        return _mirror(url, files, check, progress)


def _mirror(url: str, files: str, check: bool, progress: bool) -> str:
    fs, root = open_fs(url)
    root = root.rstrip("/")
    try:
        if not fs.isdir(root):
            if fs.exists(root):
                raise ValueError(f"checkpoint {url!r} is a file; pass the checkpoint directory")
            raise CheckpointNotFound(f"checkpoint {url!r} does not exist")
        listing = fs.find(root, detail=True)
    except (CheckpointNotFound, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - auth, network: each store's own exception types
        raise remote_error(url, e) from None
    rels = {posixpath.relpath(p.rstrip("/"), root) for p, info in listing.items()
            if info.get("type") != "directory" and not p.endswith("/")}
    if check:
        _check_listing(url, rels, need_weights=files != "config")
    local = mirror_path(url)
    os.makedirs(local, exist_ok=True)
    _remove_stale_parts(local)
    manifest_file = os.path.join(local, MANIFEST)
    try:
        with open(manifest_file) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = {}
    # our format at a URL orbax reads: its params/ tree is restored from there, each process its shards
    restored_in_place = META in rels and orbax_reads(url)
    todo = []
    for path, info in sorted(listing.items()):
        if info.get("type") == "directory" or path.endswith("/"):
            continue
        rel = posixpath.relpath(path.rstrip("/"), root)
        if rel.startswith("..") or (files == "config" and rel not in CONFIG_FILES) or \
                (files == "no-weights" and (rel.endswith(".safetensors") or (restored_in_place and
                                                                             rel.startswith("params/")))):
            continue
        dest = os.path.join(local, *rel.split("/"))
        stamp = _stamp(info)
        if manifest.get(rel) == stamp and os.path.isfile(dest) and (stamp[0] is None or
                                                                    os.path.getsize(dest) == stamp[0]):
            continue
        todo.append((path, rel, dest, stamp))
    if todo and progress:
        size = sum(s[0] or 0 for *_, s in todo)
        print(f"dgemma: copying {len(todo)} file(s), {size / 2 ** 20:.1f} MiB, of {url} into {local}",
              file=sys.stderr, flush=True)
    for path, rel, dest, stamp in todo:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = f"{dest}.part{os.getpid()}"
        try:
            fs.get_file(path, tmp)
        except Exception as e:  # noqa: BLE001
            if os.path.exists(tmp):
                os.remove(tmp)
            raise remote_error(url, e) from None
        os.replace(tmp, dest)
        manifest[rel] = stamp
        _write_manifest(manifest_file, manifest)
    if files == "all":  # files gone from the remote directory leave the mirror too (an old shard)
        for rel in [r for r in manifest if r not in rels]:
            dest = os.path.join(local, *rel.split("/"))
            if os.path.isfile(dest):
                os.remove(dest)
            del manifest[rel]
        _write_manifest(manifest_file, manifest)
    return local


def _remove_stale_parts(local: str) -> None:
    """Files a killed copy left half-written (<name>.part<pid> of a process that is gone)."""
    for dirpath, _, names in os.walk(local):
        for name in names:
            m = re.search(r"\.part(\d+)$", name)
            if not m:
                continue
            try:
                os.kill(int(m.group(1)), 0)
                continue  # a copy in progress in another process
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):
                continue
            try:
                os.remove(os.path.join(dirpath, name))
            except OSError:
                pass


def _write_manifest(path: str, manifest: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the Hugging Face Hub
def _hub_offline() -> bool:
    from huggingface_hub import constants  # deferred: ~0.2 s to import; only Hub repo ids need it

    return bool(constants.HF_HUB_OFFLINE)


def _hub_what(repo: str, revision: str | None, explicit: bool) -> str:
    at = f"{repo}@{revision}" if revision else repo
    return f"the Hugging Face Hub repo {at!r}" if explicit else \
        f"{at!r} (no local directory of that name, so read as a Hugging Face Hub repo id)"


@contextlib.contextmanager
def _hub_errors(what: str, revision: str | None):
    """huggingface_hub's failures as one-line CheckpointNotFound errors naming the fix."""
    from huggingface_hub import errors  # deferred: ~0.2 s to import; only Hub repo ids need it

    try:
        yield
    except errors.LocalEntryNotFoundError:
        raise CheckpointNotFound(
            f"{what} is not in the Hugging Face cache and the Hub cannot be reached (offline or HF_HUB_OFFLINE=1): "
            "download it once with network access, or pass a local checkpoint directory") from None
    except errors.GatedRepoError:
        raise CheckpointNotFound(f"{what} is gated: accept its terms on the Hub, then log in (`hf auth login` "
                                 "or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise CheckpointNotFound(f"{what} was not found: check the name (or, for a private repo, log in with "
                                 "`hf auth login` or HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise CheckpointNotFound(f"{what}: the repo has no revision {revision!r}; pass an existing branch, tag "
                                 "or commit (REPO@REVISION or --revision)") from None
    except errors.HfHubHTTPError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointNotFound(f"the Hub failed on {what} ({first}); retry later, or pass a local "
                                 "checkpoint directory") from None
    except (OSError, ValueError) as e:  # no network at all, a malformed id, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointNotFound(f"could not download {what} ({type(e).__name__}: {first}); check the repo id "
                                 "and the network, or pass a local checkpoint directory") from None


def _huggingface_hub(repo: str):
    """The huggingface_hub module, or a one-line CheckpointNotFound naming the fix."""
    try:
        import huggingface_hub  # deferred: ~0.2 s to import; only Hub repo ids need it
    except ImportError as e:  # pragma: no cover - a dependency of dgemma_jax
        raise CheckpointNotFound(f"reading the Hub repo {repo!r} needs huggingface_hub ({e}): "
                                 "pip install huggingface_hub") from None
    return huggingface_hub


def hub_commit(repo: str, revision: str | None = None, explicit: bool = False) -> str:
    """The commit a Hub revision (branch, tag, commit; None: main) points at now."""
    hub = _huggingface_hub(repo)
    with _hub_errors(_hub_what(repo, revision, explicit), revision):
        return hub.HfApi().repo_info(repo, revision=revision).sha


def hub_snapshot(repo: str, revision: str | None = None, files: str = "all", check: bool = True,
                 explicit: bool = False) -> str:
    """snapshot_download of a Hub repo (only a checkpoint's files; files="no-weights": all but the
    *.safetensors) -> its directory in the HF cache."""
    hub = _huggingface_hub(repo)
    what = _hub_what(repo, revision, explicit)
    if files == "config":
        which = {"allow_patterns": list(CONFIG_FILES)}
    elif files == "no-weights":
        which = {"allow_patterns": [p for p in HUB_PATTERNS if p != "*.safetensors"]}
    else:
        which = {"allow_patterns": HUB_PATTERNS} if check else {"ignore_patterns": HUB_IGNORED}
    with _hub_errors(what, revision):
        path = hub.snapshot_download(repo, revision=revision, **which)
    if check:
        try:
            if detect_format(path, need_weights=files == "all") == "hf":
                ModelConfig.from_hf(path)  # a config.json of another model type is named here
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{what} is not a DiffusionGemma checkpoint dgemma_jax can read: "
                             f"{str(e).replace(repr(path), 'it')}") from None
    return path
