"""Weights straight into their shards (issue 34, point 4): each process reads only the byte ranges of its
own shards of a safetensors checkpoint, from a local directory or straight from an fsspec store.

The store is `countfile://`, a local directory behind an fsspec filesystem that counts every byte read
through it (benchmarks/shard_load.py), so the bytes are counted, not assumed. On the code before this
change a URL was copied whole into the local mirror and every tensor was read whole by every process.
"""

import os
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from dgemma_jax.config import ModelConfig
from dgemma_jax.io.hf import REMOTE_GAP, SafetensorsDir, name_table
from dgemma_jax.pipeline import load_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import shard_load  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DGEMMA_CACHE", str(tmp_path / "dgemma_cache"))


@pytest.fixture
def counting():
    fs = shard_load._counting_filesystem()
    fs.count[0] = 0
    return fs.count


def test_a_slice_of_ours_is_read_from_the_hf_box_that_holds_it():
    """Entry.part: for random slices of every parameter (the MoE gate_up merge [E, 2F, D] -> [E, D, 2F], the
    q/k/v head splits, the o/router/down transposes), the HF box it names, laid out, is that slice of the
    whole tensor laid out as the name table says (reshape to hf_view, transpose perm, reshape to ours)."""
    cfg = ModelConfig.preset("tiny-2layer")
    rng = np.random.default_rng(0)
    for e in name_table(cfg):
        x = rng.standard_normal(e.hf_shape).astype(np.float32)
        whole = x.reshape(e.hf_view) if e.hf_view else x
        whole = (whole.transpose(e.perm) if e.perm else whole).reshape(e.shape)
        for _ in range(10):
            box = []
            for n in e.shape:
                a = int(rng.integers(0, n))
                box.append((a, int(rng.integers(a + 1, n + 1))))
            hf_box, finish = e.part(tuple(box))
            np.testing.assert_array_equal(finish(x[tuple(slice(*r) for r in hf_box)]),
                                          whole[tuple(slice(*r) for r in box)], err_msg=f"{e.hf} {box}")
            if e.hf.endswith("experts.gate_up_proj") and box[0] == (0, 1):
                assert hf_box[0] == (0, 1)  # one expert's rows only


def test_ranged_reads_fetch_the_boxes_and_merge_close_ranges(tmp_path, counting):
    """Rows of a tensor are one range; a column box is one run per row: read exactly with max_gap=0, as one
    covering range when the runs are closer than max_gap (the store default, REMOTE_GAP)."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    save_file({"a": np.ones(7, np.float32), "w": x}, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "model.safetensors", "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    url = f"countfile://{tmp_path}"

    st = SafetensorsDir(url, max_gap=0)
    assert counting[0] == header and st.shape("w") == (64, 32) and st.max_gap == 0
    rows, cols = st.read("w", [((8, 24), (0, 32)), ((0, 64), (4, 8))])
    np.testing.assert_array_equal(rows, x[8:24])
    np.testing.assert_array_equal(cols, x[:, 4:8])
    # the header once, then exactly the boxes, bytes they share read once (rows 8-23 hold 16 of the column runs)
    assert counting[0] == header + 16 * 32 * 4 + (64 - 16) * 4 * 4

    counting[0] = 0
    st = SafetensorsDir(url)
    assert st.max_gap == REMOTE_GAP
    np.testing.assert_array_equal(st.read("w", [((0, 64), (4, 8))])[0], x[:, 4:8])
    assert counting[0] == header + (63 * 32 + 8 - 4) * 4  # row 0 column 4 to row 63 column 8, in one read
    np.testing.assert_array_equal(SafetensorsDir(str(tmp_path)).get("w"), x)  # a local directory: the same reader


def test_a_store_failing_mid_load_is_one_error_naming_the_fix(tmp_path, monkeypatch):
    from dgemma_jax.io.locations import CheckpointNotFound

    save_file({"w": np.zeros((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    st = SafetensorsDir(f"countfile://{tmp_path}")

    def forbidden(*a, **k):
        raise PermissionError("403 Forbidden: no storage.objects.get access")

    monkeypatch.setattr(st.fs, "cat_ranges", forbidden)
    with pytest.raises(CheckpointNotFound, match=r"countfile://.*403 Forbidden.*sign in to the store"):
        st.get("w")


@pytest.mark.filterwarnings("ignore:the model's vocab_size")
def test_the_mirror_is_an_option_for_repeated_starts(tmp_path, counting):
    """By default a URL's weights are read from the store and never copied; mirror=True copies them once
    and reads the copy, and the next start finds the copy current and keeps it (same files, no read)."""
    from dgemma_jax.io.locations import mirror_path

    ckpt = tmp_path / "ckpt"
    shard_load.write_checkpoint(str(ckpt), dict(shard_load.SMALL, vocab_size=512))
    url = f"countfile://{ckpt}"
    want = load_checkpoint(str(ckpt), dtype="float32")[1]
    streamed = load_checkpoint(url, dtype="float32")[1]
    mirror = mirror_path(url)
    assert os.path.isfile(os.path.join(mirror, "config.json"))
    assert not [f for f in os.listdir(mirror) if f.endswith(".safetensors")]
    assert counting[0] >= shard_load.file_bytes(str(ckpt))["weights"]  # read from the store

    def copies():
        return {f: os.stat(os.path.join(mirror, f)).st_ino for f in os.listdir(mirror) if f.endswith(".safetensors")}

    mirrored = load_checkpoint(url, dtype="float32", mirror=True)[1]
    first = copies()
    assert len(first) == 3
    counting[0] = 0
    again = load_checkpoint(url, dtype="float32", mirror=True)[1]
    assert copies() == first and counting[0] == 0  # the second start: the listing only
    for got in (streamed, mirrored, again):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)

    from dgemma_jax.cli import build_parser
    from dgemma_jax.cli_run import load_model_for_cli

    p = build_parser()
    assert p.parse_args(["generate"]).mirror is None and p.parse_args(["serve", "--mirror"]).mirror is True
    assert p.parse_args(["serve", "--no-mirror"]).mirror is False
    assert not hasattr(p.parse_args(["inspect"]), "mirror")  # inspect reads no weights
    os.remove(os.path.join(mirror, next(iter(first))))  # the command line's --mirror copies again
    args = p.parse_args(["chat", "--checkpoint", url, "--mirror", "--dtype", "float32"])
    cli = load_model_for_cli(args)[1]
    assert len(copies()) == 3
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), cli, want)


@pytest.mark.filterwarnings("ignore:the model's vocab_size")
def test_two_processes_each_read_their_own_shards_from_the_store(tmp_path):
    """Two CPU processes of 4 devices each (jax.distributed, gloo) load a bfloat16 checkpoint in three
    safetensors files from countfile:// as float32 on the mesh expert=8.

    Each process's counted bytes are at least its shards' share (its devices' distinct slices, from jax's
    `addressable_devices_indices_map`; replicated tensors such as norms, the router and the 2 kv heads
    count whole for both) plus the safetensors headers, and at most that plus the small files (config,
    tokenizer, index: copied into the mirror, the index read once more) plus the [out, in] matrices
    split along their inner axis (o_proj, the dense and self-conditioning down_proj): a process's slice
    of those is one run per row, under REMOTE_GAP apart, so it reads one covering range instead. Every
    slice equals the same slice of a one-process load, exactly."""
    ckpt = tmp_path / "ckpt"
    shard_load.write_checkpoint(str(ckpt), shard_load.SMALL)
    sizes = shard_load.file_bytes(str(ckpt))
    bounds = shard_load.share_bounds(str(ckpt))
    results = shard_load.run(str(ckpt), str(tmp_path / "out"), processes=2, devices=4, dtype="float32")

    for r in results:
        print(f"process {r['process']}: read {r['bytes_read']} bytes, its shards {r['share']}, the checkpoint "
              f"{sizes['weights'] + sizes['headers']}; peak RSS {r['peak_rss_mb']} MB ({r['rss_before_mb']} MB "
              f"before the load), {r['load_s']} s")
        assert (r["share"] + sizes["headers"] <= r["bytes_read"]
                <= r["share"] + sizes["headers"] + bounds["small"] + bounds["covering"])
        assert r["bytes_read"] < 0.65 * (sizes["weights"] + sizes["headers"])  # not the whole checkpoint
        assert r["peak_rss_mb"] >= r["rss_before_mb"] > 0  # VmHWM and VmRSS from /proc, reported above

    shard_load.check_pieces(str(ckpt), str(tmp_path / "out"), processes=2)


def test_our_format_at_gs_is_restored_in_place_not_copied(tmp_path):
    """A checkpoint in our format at gs:// (a local GCS that gcsfs and tensorstore both talk to): orbax
    restores its params/ straight from the bucket, on one device and sharded over expert=2, and the
    answer equals the local checkpoint's; only the small files land in the mirror. --mirror copies the
    params too. A params file cut short in the bucket is named before orbax reads anything."""
    import subprocess

    from tests.helpers.fake_gcs import fake_gcs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cache = tmp_path / "cache"
    with fake_gcs("bkt") as env:
        env = dict(os.environ, **env, PYTHONPATH=root, JAX_PLATFORMS="cpu", DGEMMA_CACHE=str(cache),
                   XLA_FLAGS="--xla_force_host_platform_device_count=2")
        from dgemma_jax.training.bundled import asset_path

        put = ("import gcsfs, sys; gcsfs.GCSFileSystem(use_listings_cache=False).put(sys.argv[1], 'bkt/tiny', "
               "recursive=True)")
        subprocess.run([sys.executable, "-c", put, asset_path()], env=env, check=True, timeout=120)

        def generate(checkpoint, *extra):
            r = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "generate", "--prompt", "s9350814272=",
                                "--checkpoint", checkpoint, *extra], env=env, capture_output=True, text=True,
                               timeout=300, cwd=root)
            assert r.returncode == 0, r.stderr[-3000:]
            return r

        local = generate(asset_path()).stdout
        assert local.strip() == "0122345789"
        mirror = cache / "checkpoints" / "gs" / "bkt" / "tiny"
        for extra in ((), ("--mesh", "expert=2")):
            assert generate("gs://bkt/tiny", *extra).stdout == local
            assert (mirror / "dgemma_model.json").is_file() and not (mirror / "params").exists()
        assert generate("gs://bkt/tiny", "--mirror").stdout == local
        assert (mirror / "params").is_dir()

        cut = ("import gcsfs, sys; fs = gcsfs.GCSFileSystem(use_listings_cache=False); "
               "f = max((p for p in fs.find('bkt/tiny/params') if fs.size(p) > 8), key=fs.size); "
               "fs.pipe(f, fs.cat(f)[:8]); print(f)")
        damaged = subprocess.run([sys.executable, "-c", cut], env=env, check=True, timeout=120,
                                 capture_output=True, text=True).stdout.strip()
        r = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "generate", "--prompt", "s9350814272=",
                            "--checkpoint", "gs://bkt/tiny"], env=env, capture_output=True, text=True,
                           timeout=300, cwd=root)
        rel = damaged.removeprefix("bkt/tiny/")
        assert r.returncode != 0 and f"{rel} is 8 bytes, saved as" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
