"""Checkpoint locations (issue 20, point 2): gs:// and other fsspec URLs, and Hugging Face Hub repo ids.

The remote store is fsspec's in-process "memory://" filesystem, read through the same code as gs://
(fsspec.core.url_to_fs -> find -> get_file); the Hub is huggingface_hub.snapshot_download, replaced
at that boundary only. No network. The checkpoint is the bundled model (and its parameters written
as a Hugging Face safetensors directory). On the code before this change every remote location
failed with "... does not exist".
"""

import importlib
import json
import os
import shutil
import uuid

import numpy as np
import pytest

from dgemma_jax.cli import main as dgemma
from dgemma_jax.training.bundled import asset_path

PROMPT = "s9350814272="


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Each test mirrors into its own cache; the Hub is never reached for real."""
    monkeypatch.setenv("DGEMMA_CACHE", str(tmp_path / "dgemma_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def memory_store():
    """A fresh directory in fsspec's memory filesystem, removed afterwards: -> (fs, "/root")."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/store-{uuid.uuid4().hex[:8]}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _generate(capsys, checkpoint, *extra):
    capsys.readouterr()
    rc = dgemma(["generate", "--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "16",
                 "--quiet", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out, out.err


def _one_line_error(capsys, argv):
    capsys.readouterr()
    rc = dgemma(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("dgemma: error:"), err
    return lines[0]


# ------------------------------------------------------------------ fsspec URLs (gs:// and the like)
def test_generate_from_a_remote_orbax_checkpoint_gives_the_local_tokens_and_copies_once(memory_store, capsys):
    fs, root = memory_store
    fs.put(asset_path(), f"{root}/tiny", recursive=True)
    url = f"memory:/{root}/tiny"
    local_text, _ = _generate(capsys, asset_path())
    text, err = _generate(capsys, url)
    assert text == local_text and text.strip() == "0122345789"
    assert "copying" in err and url in err
    # the second run reads the mirror: nothing copied again
    text, err = _generate(capsys, url)
    assert text == local_text and "copying" not in err
    from dgemma_jax.io.locations import mirror_path

    assert os.path.isfile(os.path.join(mirror_path(url), "dgemma_model.json"))
    assert mirror_path(url).startswith(os.environ["DGEMMA_CACHE"])


def test_the_mirror_follows_the_remote_directory(memory_store, capsys):
    """A changed file is copied again, a removed one leaves the mirror, an unchanged one stays."""
    from dgemma_jax.io.locations import mirror_path, resolve

    fs, root = memory_store
    fs.put(asset_path(), f"{root}/tiny", recursive=True)
    url = f"memory:/{root}/tiny"
    local = resolve(url)
    before = os.stat(os.path.join(local, "dgemma_model.json")).st_mtime_ns
    meta = json.loads(fs.cat(f"{root}/tiny/metadata.json"))
    meta["note"] = "changed"
    fs.pipe(f"{root}/tiny/metadata.json", json.dumps(meta).encode())
    fs.pipe(f"{root}/tiny/extra.txt", b"x")
    capsys.readouterr()
    assert resolve(url) == local == mirror_path(url)
    assert "2 file(s)" in capsys.readouterr().err
    assert json.load(open(os.path.join(local, "metadata.json")))["note"] == "changed"
    assert os.stat(os.path.join(local, "dgemma_model.json")).st_mtime_ns == before
    fs.rm(f"{root}/tiny/extra.txt")
    resolve(url)
    assert not os.path.exists(os.path.join(local, "extra.txt"))
    assert not [f for f in os.listdir(local) if ".part" in f]


def test_an_interrupted_copy_is_finished_by_the_next_run(memory_store, monkeypatch, capsys):
    """A copy that fails midway is a one-line error; nothing half-written is taken for a file, and the
    next run copies what is missing (a leftover .part of a killed process is removed)."""
    from fsspec.implementations.memory import MemoryFileSystem

    from dgemma_jax.io.locations import mirror_path, resolve

    fs, root = memory_store
    fs.put(asset_path(), f"{root}/tiny", recursive=True)
    url = f"memory:/{root}/tiny"
    real_get, copied = MemoryFileSystem.get_file, []

    def flaky_get(self, rpath, lpath, *a, **kw):
        if len(copied) == 3:
            with open(lpath, "wb") as f:
                f.write(b"half")
            raise ConnectionResetError("the connection dropped")
        copied.append(rpath)
        return real_get(self, rpath, lpath, *a, **kw)

    monkeypatch.setattr(MemoryFileSystem, "get_file", flaky_get)
    capsys.readouterr()
    assert dgemma(["generate", "--checkpoint", url, "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err
    progress, msg = err.strip().splitlines()  # the copy's progress line, then the error in one line
    assert progress.startswith("dgemma: copying") and msg.startswith("dgemma: error:")
    assert "ConnectionResetError: the connection dropped" in msg and url in msg
    local = mirror_path(url)
    assert not [f for _, _, fs_ in os.walk(local) for f in fs_ if ".part" in f]
    with open(os.path.join(local, "tokenizer.json.part999999999"), "w") as f:
        f.write("left by a killed copy")
    monkeypatch.setattr(MemoryFileSystem, "get_file", real_get)
    capsys.readouterr()
    assert resolve(url) == local
    total = len(fs.find(f"{root}/tiny"))
    assert f"{total - 3} file(s)" in capsys.readouterr().err  # all files less the 3 copied before
    for rel in fs.find(f"{root}/tiny"):
        with open(os.path.join(local, os.path.relpath(rel, f"{root}/tiny")), "rb") as f:
            assert f.read() == fs.cat(rel), rel
    assert not os.path.exists(os.path.join(local, "tokenizer.json.part999999999"))


def test_a_remote_safetensors_directory_loads_like_the_local_one(memory_store, tmp_path, capsys):
    """Hugging Face format (config.json + model.safetensors + tokenizer) from a URL: load_hf,
    dgemma inspect (the config files only) and dgemma convert."""
    import jax

    from dgemma_jax import load_hf, save_hf
    from dgemma_jax.training.bundled import load_bundled

    cfg, params, _, _ = load_bundled()
    hf_dir = tmp_path / "hf"
    save_hf(params, cfg, hf_dir)
    shutil.copyfile(os.path.join(asset_path(), "tokenizer.json"), hf_dir / "tokenizer.json")
    fs, root = memory_store
    fs.put(str(hf_dir), f"{root}/hf", recursive=True)
    url = f"memory:/{root}/hf"

    capsys.readouterr()
    assert dgemma(["inspect", "--checkpoint", url, "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["layers"] == cfg.num_layers
    from dgemma_jax.io.locations import mirror_path

    assert sorted(f for f in os.listdir(mirror_path(url)) if not f.startswith(".")) == ["config.json"]

    want_cfg, want = load_hf(hf_dir)
    got_cfg, got = load_hf(url)
    assert got_cfg == want_cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)

    dst = tmp_path / "ours"
    assert dgemma(["convert", url, str(dst), "--quiet"]) == 0, capsys.readouterr().err
    assert (dst / "dgemma_model.json").is_file() and (dst / "tokenizer.json").is_file()


def test_remote_errors_are_one_line(memory_store, capsys):
    fs, root = memory_store
    msg = _one_line_error(capsys, ["generate", "--checkpoint", f"memory:/{root}/missing", "--prompt", PROMPT])
    assert "does not exist" in msg and "memory:/" in msg
    fs.pipe(f"{root}/empty/readme.txt", b"not a checkpoint")
    msg = _one_line_error(capsys, ["generate", "--checkpoint", f"memory:/{root}/empty", "--prompt", PROMPT])
    assert "not a checkpoint" in msg
    msg = _one_line_error(capsys, ["generate", "--checkpoint", "nosuchprotocol://b/x", "--prompt", PROMPT])
    assert "nosuchprotocol" in msg
    msg = _one_line_error(capsys, ["generate", "--checkpoint", f"memory:/{root}/empty", "--revision", "v1",
                                   "--prompt", PROMPT])
    assert "--revision applies to Hugging Face Hub repo ids" in msg


def test_gs_without_gcsfs_names_the_extra(monkeypatch, capsys):
    # gcsfs is an extra ([gcs], part of [tpu]); fsspec raises ImportError for gs:// without it
    import fsspec

    def no_gcsfs(url, **kw):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_gcsfs)
    msg = _one_line_error(capsys, ["generate", "--checkpoint", "gs://bucket/model", "--prompt", PROMPT])
    assert "gcsfs" in msg and "dgemma_jax[gcs]" in msg


def test_where_a_location_goes():
    from dgemma_jax.io.locations import kind, mirror_path, resolve, split_revision

    assert kind(asset_path()) == "local" and resolve(asset_path()) == asset_path()
    assert kind("/no/such/dir") == "local" and resolve("/no/such/dir") == "/no/such/dir"  # the loader says so
    assert kind("./org/name") == "local" and kind("a/b/c") == "local" and kind("name") == "local"
    assert kind("gs://bucket/ckpt") == "url" and kind("s3://b/c") == "url" and kind("file:///x") == "local"
    assert kind("google/diffusiongemma-26b-a4b") == "hub" and kind("org/name@v1.0") == "hub"
    assert kind("hf://gpt2") == "hub"
    assert split_revision("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
    assert split_revision("org/name", "abc") == ("org/name", "abc")
    with pytest.raises(ValueError, match="give it once"):
        split_revision("org/name@a", "b")
    assert mirror_path("gs://bucket/a/b/").endswith(os.path.join("checkpoints", "gs", "bucket", "a", "b"))


# ------------------------------------------------------------------ the Hugging Face Hub
@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """huggingface_hub.snapshot_download replaced: records its calls, returns a copy of the bundled
    model (or raises `fake_hub.error`)."""
    import huggingface_hub

    snapshot = tmp_path / "hub_snapshot"
    shutil.copytree(asset_path(), snapshot)

    class Hub:
        calls = []
        error = None
        path = snapshot

    def snapshot_download(repo_id, **kw):
        Hub.calls.append((repo_id, kw))
        if Hub.error is not None:
            raise Hub.error
        return str(Hub.path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return Hub


def test_generate_from_a_hub_repo_pinned_to_a_revision(fake_hub, capsys):
    local_text, _ = _generate(capsys, asset_path())
    text, _ = _generate(capsys, "my-org/dgemma-tiny@abc123")
    assert text == local_text
    (repo, kw), = fake_hub.calls
    assert repo == "my-org/dgemma-tiny" and kw["revision"] == "abc123"
    from dgemma_jax.io.locations import HUB_PATTERNS

    assert kw["allow_patterns"] == HUB_PATTERNS
    text, _ = _generate(capsys, "hf://my-org/dgemma-tiny", "--revision", "v2")
    assert text == local_text and fake_hub.calls[-1][0] == "my-org/dgemma-tiny"
    assert fake_hub.calls[-1][1]["revision"] == "v2"
    # the library: from_pretrained takes the same locations
    from dgemma_jax.pipeline import DiffusionGemma

    dg = DiffusionGemma.from_pretrained("my-org/dgemma-tiny", revision="main")
    assert dg.config.name == "dgemma-tiny-digits" and fake_hub.calls[-1][1]["revision"] == "main"
    # dgemma inspect asks for the config files only; dgemma convert for any layout (a gemma orbax tree)
    from dgemma_jax.io.locations import CONFIG_FILES, HUB_IGNORED

    capsys.readouterr()
    assert dgemma(["inspect", "--checkpoint", "my-org/dgemma-tiny@v3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "dgemma-tiny-digits"
    assert fake_hub.calls[-1] == ("my-org/dgemma-tiny", {"revision": "v3", "allow_patterns": list(CONFIG_FILES)})
    from dgemma_jax.io.locations import resolve

    assert resolve("my-org/gemma-layout", check=False) == str(fake_hub.path)
    assert fake_hub.calls[-1][1] == {"revision": None, "ignore_patterns": HUB_IGNORED}


def _hub_error(name, status=404):
    from huggingface_hub import errors

    cls = getattr(errors, name)
    if not issubclass(cls, errors.HfHubHTTPError):
        return cls("no cached snapshot")
    http = importlib.import_module(errors.HTTPError.__module__.split(".")[0])  # httpx / httpx2: hub's own
    url = "https://huggingface.co/api/models/my-org/dgemma-tiny"
    return cls(f"{status} Client Error for url {url}\nmore detail on a second line",
               response=http.Response(status, request=http.Request("GET", url)))


@pytest.mark.parametrize("error, expect", [
    ("LocalEntryNotFoundError", "not in the Hugging Face cache and the Hub cannot be reached"),
    ("RepositoryNotFoundError", "was not found: check the name"),
    ("GatedRepoError", "is gated"),
    ("RevisionNotFoundError", "has no revision 'nope'"),
    ("HfHubHTTPError", "retry later"),
])
def test_hub_errors_are_one_line_naming_the_fix(fake_hub, capsys, error, expect):
    fake_hub.error = _hub_error(error, 500 if error == "HfHubHTTPError" else 404)
    msg = _one_line_error(capsys, ["generate", "--checkpoint", "my-org/dgemma-tiny", "--revision", "nope",
                                   "--prompt", PROMPT])
    assert expect in msg and "my-org/dgemma-tiny" in msg, msg


def test_a_hub_repo_that_is_not_a_diffusiongemma_checkpoint(fake_hub, tmp_path, capsys):
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (other / "model.safetensors").write_bytes(b"")
    fake_hub.path = other
    msg = _one_line_error(capsys, ["generate", "--checkpoint", "my-org/llama", "--prompt", PROMPT])
    assert "not a DiffusionGemma checkpoint" in msg and "llama" in msg
    (other / "model.safetensors").unlink()
    (other / "pytorch_model.bin").write_bytes(b"")
    msg = _one_line_error(capsys, ["inspect", "--checkpoint", "my-org/llama"])
    assert "not a DiffusionGemma checkpoint" in msg
    msg = _one_line_error(capsys, ["generate", "--prompt", PROMPT, "--revision", "v1"])
    assert "--revision applies to a Hugging Face Hub checkpoint" in msg


# ------------------------------------------------------------------ the other entry points
def test_every_command_that_loads_a_model_takes_a_revision():
    from dgemma_jax.cli import build_parser

    p = build_parser()
    for argv in (["generate"], ["chat"], ["serve"], ["inspect"], ["convert", "SRC", "DST"]):
        args = p.parse_args(argv + ["--revision", "abc123"])
        assert args.revision == "abc123"


def test_the_trainer_initialises_from_a_remote_checkpoint(memory_store):
    import jax

    from dgemma_jax.training.bundled import load_bundled
    from dgemma_jax.training.recipe import InitSection, ModelSection
    from dgemma_jax.training.train import build_model_and_params

    fs, root = memory_store
    fs.put(asset_path(), f"{root}/tiny", recursive=True)
    cfg, params = build_model_and_params(ModelSection(), InitSection(kind="bundled", path=f"memory:/{root}/tiny"),
                                         None)
    want_cfg, want, _, _ = load_bundled()
    assert cfg == want_cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, want)
