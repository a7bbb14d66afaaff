"""A Hugging Face Hub checkpoint read straight into its shards (issue 34, point 4): with several
processes (a pod) each reads only its own shards' byte ranges from the Hub, and no host downloads the
whole model; one process downloads it into the Hugging Face cache, as before.

The Hub is `tests/helpers/fake_hub.py`, a local server answering the Hub's HTTP API, so that
huggingface_hub's own clients run unchanged (`snapshot_download`, `HfApi.repo_info`, the `hf://`
filesystem); the bytes are counted where the Hub sends them, per process. On the code before this
change every process downloaded the whole repo into its Hugging Face cache.
"""

import os
import sys

import jax
import numpy as np
import pytest

from dgemma_jax.io.hf import SafetensorsDir
from dgemma_jax.io.locations import CheckpointNotFound, locate
from dgemma_jax.pipeline import load_checkpoint
from tests.helpers.fake_hub import fake_hub

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import shard_load  # noqa: E402

REPO = "my-org/dgemma-small"
pytestmark = pytest.mark.filterwarnings("ignore:the model's vocab_size")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hub_repo") / "ckpt"
    shard_load.write_checkpoint(str(path), shard_load.SMALL)
    return str(path)


@pytest.fixture
def hub(checkpoint, tmp_path, monkeypatch):
    """The fake Hub serving the checkpoint, this process's huggingface_hub pointed at it as client "me",
    and a fresh Hugging Face cache."""
    from huggingface_hub import HfFileSystem, constants

    with fake_hub({REPO: checkpoint}) as server:
        endpoint = server.endpoint("me")
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
        monkeypatch.setenv("DGEMMA_CACHE", str(tmp_path / "dgemma_cache"))
        # online, whatever an earlier test in this process left huggingface_hub reading at its import
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        HfFileSystem.clear_instance_cache()
        yield server
        HfFileSystem.clear_instance_cache()


def _weights(tmp_path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "hf_cache") for f in fs if f.endswith(".safetensors")]


def _same(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_one_process_downloads_the_repo_and_direct_reads_leave_the_weights_on_the_hub(hub, checkpoint, tmp_path):
    """mirror=None with one process: the repo's files land in the HF cache (the weights included, whole);
    mirror=False: the weights are read from hf://REPO@COMMIT in ranges (the revision pinned to the commit
    `main` points at), none is written to disk, and the parameters equal the local load's."""
    want = load_checkpoint(checkpoint, dtype="float32")[1]
    weights = shard_load.file_bytes(checkpoint)["weights"]

    direct = load_checkpoint(REPO, dtype="float32", mirror=False)[1]
    _same(direct, want)
    assert _weights(tmp_path) == []  # config and tokenizer only
    assert weights <= hub.sent["me"] < 1.1 * weights  # every tensor once, whole: one process holds them all
    local, url = locate(REPO, mirror=False)
    assert url == f"hf://{REPO}@{hub.sha[REPO]}" and os.path.isfile(os.path.join(local, "tokenizer.json"))

    hub.sent.clear()
    downloaded = load_checkpoint(REPO, dtype="float32")[1]
    _same(downloaded, want)
    assert len(_weights(tmp_path)) == 3 and hub.sent["me"] >= weights  # the download
    hub.sent.clear()
    _same(load_checkpoint(REPO, dtype="float32")[1], want)
    assert hub.sent["me"] == 0  # the second start reads the cache


def test_hub_ranges_are_exact_requests_not_read_ahead_blocks(hub, checkpoint):
    """fsspec's buffered file would fetch megabytes around an 8-byte read; each range is one exact HTTP
    range request instead (a column box of a matrix: one covering range at most REMOTE_GAP long)."""
    st = SafetensorsDir(f"hf://{REPO}@main")
    headers = hub.sent["me"]
    sizes = shard_load.file_bytes(checkpoint)
    index = os.path.getsize(os.path.join(checkpoint, "model.safetensors.index.json"))
    assert headers == sizes["headers"] + index  # the index, then each file's 8-byte length and JSON header
    name = next(k for k in st.keys() if k.endswith("layers.0.self_attn.q_proj.weight"))
    hub.sent.clear()
    rows = st.read(name, [((0, 16), (0, st.shape(name)[1]))])[0]
    assert hub.sent["me"] == rows.nbytes  # 16 rows of bfloat16: one range, nothing around it
    np.testing.assert_array_equal(rows, SafetensorsDir(checkpoint).read(name, [((0, 16), (0, st.shape(name)[1]))])[0])


def test_a_missing_repo_or_revision_is_one_line_naming_the_fix(hub):
    with pytest.raises(CheckpointNotFound, match="was not found: check the name"):
        locate("my-org/no-such-repo", mirror=False)
    with pytest.raises(CheckpointNotFound, match="has no revision 'v9'; pass an existing branch"):
        locate(REPO, "v9", mirror=False)


def test_two_processes_each_read_their_own_shards_from_the_hub(hub, checkpoint, tmp_path):
    """Two CPU processes of 4 devices each (jax.distributed, gloo) load the repo id on the mesh expert=8
    with the defaults: each is sent at most its shards' share plus the small files and covering reads
    (the bounds of test_shard_reads' store test), far less than the checkpoint, and neither writes a
    weight file; every slice equals the one-process load's."""
    sizes = shard_load.file_bytes(checkpoint)
    bounds = shard_load.share_bounds(checkpoint)
    results = shard_load.run(checkpoint, str(tmp_path / "out"), processes=2, devices=4, dtype="float32",
                             url=REPO, env_for=lambda i: {"HF_ENDPOINT": hub.endpoint(f"p{i}"),
                                                          "HF_HUB_CACHE": str(tmp_path / f"hf_cache{i}")})
    for r in results:
        sent = hub.sent[f"p{r['process']}"]
        print(f"process {r['process']}: sent {sent} bytes by the Hub, its shards {r['share']}, the checkpoint "
              f"{sizes['weights'] + sizes['headers']}; peak RSS {r['peak_rss_mb']} MB")
        assert r["share"] + sizes["headers"] <= sent <= r["share"] + sizes["headers"] + bounds["small"] + bounds["covering"]
        assert sent < 0.65 * (sizes["weights"] + sizes["headers"])
        cache = tmp_path / f"hf_cache{r['process']}"
        assert not [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".safetensors")]
    shard_load.check_pieces(checkpoint, str(tmp_path / "out"), processes=2)
