"""Training: corruption statistics, canvas layout, the block mask (leakage), self-conditioning off,
LoRA (only adapters change; merged = base + adapters; the unmerged forward is tests/test_training_lora.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import init_params
from dgemma_jax.runtime import Runtime
from dgemma_jax.training import lora as lora_lib
from dgemma_jax.training.corruption import corrupt, sample_t
from dgemma_jax.training.data import Layout, TaskSource, chunk_example
from dgemma_jax.training.objective import ObjectiveConfig, gather_canvas, loss_fn
from dgemma_jax.training.optim import make_optimizer
from dgemma_jax.training.step import LoraSpec, init_train_state, make_train_step
from dgemma_jax.training.tasks import Task, TaskMix, task_tokenizer
from dgemma_jax.training.train import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny():
    rc = load_config(os.path.join(ROOT, "configs", "train_tiny.py"))
    cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in rc.model.overrides.to_dict().items()})
    params = init_params(cfg, 0)
    lay = Layout(prompt_length=12, num_canvases=3, canvas_length=cfg.canvas_length)
    src = TaskSource(TaskMix([Task("sort", 8, 9)]), task_tokenizer(), lay, batch_size=4, seed=3)
    return cfg, params, lay, src


# ---------------------------------------------------------------------------- corruption
def test_corruption_statistics():
    v, b, l = 18, 6, 4096
    x = jax.random.randint(jax.random.key(0), (b, l), 0, v)
    t = jnp.asarray([1e-3, 0.1, 0.3, 0.5, 0.9, 1.0])
    noisy, replaced = corrupt(jax.random.key(1), x, t, v)
    frac = np.asarray(replaced.mean(-1))
    np.testing.assert_allclose(frac, np.asarray(t), atol=0.03)       # replaced fraction ~ t
    changed = np.asarray((noisy != x).mean(-1))
    np.testing.assert_allclose(changed, np.asarray(t) * (1 - 1 / v), atol=0.03)
    # t = eps keeps (almost) everything; t = 0 exactly keeps everything
    assert changed[0] < 0.005
    same, _ = corrupt(jax.random.key(2), x, jnp.zeros((b,)), v)
    assert (np.asarray(same) == np.asarray(x)).all()
    # t = 1: every position replaced, tokens uniform over the whole vocab, independent of x
    assert bool(replaced[-1].all())
    counts = np.bincount(np.asarray(noisy[-1]), minlength=v)
    expected = l / v
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45.0, chi2                                          # df = 17, p ~ 3e-4
    assert abs(float((noisy[-1] == x[-1]).mean()) - 1 / v) < 0.02
    ts = np.asarray(sample_t(jax.random.key(3), 20000, 1e-3))
    assert ts.min() >= 1e-3 and ts.max() <= 1.0 and abs(ts.mean() - 0.5005) < 0.01


def test_canvas_layout():
    lay = Layout(prompt_length=3, num_canvases=3, canvas_length=4, eos_id=1, pad_id=0)
    toks, length, plen, n = chunk_example([2, 7], [10, 11, 12, 13, 14], lay)
    assert (plen, n, length) == (2, 2, 10)
    np.testing.assert_array_equal(toks, [2, 7, 10, 11, 12, 13, 14, 1, 1, 1, 0, 0, 0, 0, 0])
    # a response filling whole canvases still gets an EOS canvas
    toks, length, plen, n = chunk_example([2], [5, 5, 5, 5], lay)
    assert n == 2 and list(toks[5:9]) == [1, 1, 1, 1]
    # long prompts keep their end; long responses are cut at C * L
    toks, length, plen, n = chunk_example([2, 3, 4, 5, 6], list(range(3, 20)), lay)
    assert plen == 3 and list(toks[:3]) == [4, 5, 6] and n == 3 and length == 15 and 1 not in toks[3:]


# ---------------------------------------------------------------------------- leakage
def test_block_mask_leakage(tiny):
    """The selected canvas's prediction ignores its own clean copy and later canvases, and depends
    on earlier canvases and the prompt (through both decoder passes and self-conditioning)."""
    cfg, params, lay, src = tiny
    batch = {k: jnp.asarray(v) for k, v in src.batch(0).items()}
    assert (np.asarray(batch["num_canvases"]) == 3).all()            # 8-9 digits + EOS = 3 canvases of 4
    b, L = batch["tokens"].shape[0], lay.canvas_length
    sel = jnp.ones((b,), jnp.int32)                                  # the middle canvas
    noisy = jax.random.randint(jax.random.key(5), (b, L), 0, cfg.vocab_size)
    obj = ObjectiveConfig(canvas_length=L, sc_prob=0.5, ar_weight=1.0)
    target = gather_canvas(batch["tokens"], batch["prompt_lengths"] + L, L)   # fixed targets

    @jax.jit
    def run(tokens):
        bt = dict(batch, tokens=tokens)
        _, m = loss_fn(params, bt, jax.random.key(0), config=cfg, obj=obj, canvas_override=sel,
                       t_override=jnp.full((b,), 0.5), noise_override=noisy, sc_override=jnp.asarray([1, 0, 1, 0], bool),
                       return_logits=True)
        lp = jax.nn.log_softmax(m["logits"], -1)
        ce = -jnp.take_along_axis(lp, target[..., None], -1)[..., 0]
        return m["logits"], ce.mean()

    plen = np.asarray(batch["prompt_lengths"])
    base_logits, base_loss = run(batch["tokens"])

    def edit(canvas_index=None, prompt=False):
        t = np.array(batch["tokens"])
        for r in range(b):
            if prompt:
                sl = slice(1, plen[r])
            else:
                s0 = plen[r] + canvas_index * L
                sl = slice(s0, s0 + L)
            t[r, sl] = (t[r, sl] + 5) % cfg.vocab_size
        return jnp.asarray(t)

    for changed in (edit(1), edit(2)):            # its own clean copy, a later canvas
        logits, loss = run(changed)
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(base_logits))
        assert float(loss) == float(base_loss)
    for changed in (edit(0), edit(prompt=True)):  # an earlier canvas, the prompt
        logits, loss = run(changed)
        diff = np.abs(np.asarray(logits) - np.asarray(base_logits)).max(axis=(1, 2))
        assert (diff > 1e-4).all(), diff
        assert float(loss) != float(base_loss)


def test_self_conditioning_off_is_exactly_zero(tiny):
    cfg, params, lay, src = tiny
    from dgemma_jax.model.api import denoise_logits
    from dgemma_jax.training.objective import encoder_pass

    batch = {k: jnp.asarray(v) for k, v in src.batch(1).items()}
    b, L = batch["tokens"].shape[0], lay.canvas_length
    sel = jnp.zeros((b,), jnp.int32)
    noisy = jax.random.randint(jax.random.key(6), (b, L), 0, cfg.vocab_size)
    obj = ObjectiveConfig(canvas_length=L, sc_prob=0.5, ar_weight=0.0)

    @jax.jit
    def run(sc_on):
        _, m = loss_fn(params, batch, jax.random.key(0), config=cfg, obj=obj, canvas_override=sel,
                       t_override=jnp.full((b,), 0.5), noise_override=noisy, sc_override=sc_on, return_logits=True)
        _, cache = encoder_pass(cfg, params, batch["tokens"], batch["lengths"], False)
        ref = denoise_logits(params, cfg, noisy, batch["prompt_lengths"], cache)
        return m["logits"], ref

    off, ref = run(jnp.zeros((b,), bool))
    on, _ = run(jnp.ones((b,), bool))
    off_err = np.abs(np.asarray(off) - np.asarray(ref)).max()    # float noise between two programs
    on_diff = np.abs(np.asarray(on) - np.asarray(ref)).max()
    assert off_err < 1e-4 and on_diff > 100 * max(off_err, 1e-6), (off_err, on_diff)
    assert gather_canvas(batch["tokens"], batch["prompt_lengths"], L).shape == (b, L)


# ---------------------------------------------------------------------------- LoRA
def test_lora_changes_only_adapters_and_merges(tiny):
    cfg, params, lay, src = tiny
    groups = ("attention", "mlp", "experts", "self_conditioning")
    spec = LoraSpec(rank=2, alpha=4.0, groups=groups)
    adapters = lora_lib.init_lora(cfg, params, jax.random.key(1), spec.rank, groups)
    merged0 = lora_lib.merge(cfg, params, adapters, spec.alpha, spec.rank)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), merged0, params)

    opt, sched = make_optimizer(peak_lr=1e-2, end_lr=1e-3, warmup_steps=1, total_steps=3)
    state = init_train_state(adapters, opt, 0)
    step = make_train_step(cfg, ObjectiveConfig(canvas_length=lay.canvas_length), opt, schedule=sched, lora=spec)
    base_copy = jax.tree_util.tree_map(np.array, params)
    for i in range(3):
        state, m = step(state, params, src.batch(i))
        assert np.isfinite(float(m["loss"]))
    # the base never changes; every adapter B moved away from zero
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, base_copy)
    trained = jax.device_get(state.params)
    leaves = lora_lib._lora_leaves(trained)
    assert len(leaves) == len(lora_lib.target_paths(cfg, groups))
    a0 = lora_lib._lora_leaves(jax.device_get(lora_lib.init_lora(cfg, params, jax.random.key(1), spec.rank, groups)))
    for p, ab in leaves.items():
        assert np.abs(ab["b"]).max() > 0, p
        # A gets gradients too once B is nonzero (through the unmerged (x A) B term)
        assert np.abs(ab["a"] - a0[p]["a"]).max() > 0, p
    # merged == base + (alpha / r) A @ B, recomputed here independently
    merged = jax.device_get(lora_lib.merge(cfg, params, trained, spec.alpha, spec.rank))
    flat_m = {lora_lib.path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(merged)[0]}
    flat_b = {lora_lib.path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(base_copy)[0]}
    assert "blocks_0/attn/q" in leaves and "blocks_1/moe/gate_up" in leaves and "sc_mlp/down" in leaves
    assert not any("router" in p or "norm" in p or p == "embedding" for p in leaves)
    for p, w in flat_b.items():
        if p in leaves:
            a, bm = leaves[p]["a"], leaves[p]["b"]
            want = w + (spec.alpha / spec.rank) * np.einsum("...ir,...ro->...io", a, bm).reshape(w.shape)
            np.testing.assert_allclose(flat_m[p], want, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(flat_m[p], w)


def router_parameters(cfg, params) -> dict:
    """{path: array} of every router parameter, found by walking the parameter tree: each leaf in a
    MoE scope that is not an expert kernel (expert kernels are the leaves with an "experts" axis)."""
    from dgemma_jax.model.api import logical_axes

    specs = jax.tree_util.tree_flatten_with_path(logical_axes(cfg),
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    axes = {lora_lib.path_str(p): tuple(s) for p, s in specs}
    leaves = {lora_lib.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    return {p: x for p, x in leaves.items() if "moe" in p.split("/")[:-1] and "experts" not in axes[p]}


def test_freeze_router_keeps_every_router_parameter(tiny):
    """Full fine-tuning with optimizer.freeze_router (the driver's optimizer): after 3 steps every
    router parameter the tree holds is bit-identical, while the experts and the rest train."""
    from dgemma_jax.training.train import Run

    cfg = tiny[0]
    run = Run(load_config(os.path.join(ROOT, "configs", "train_tiny.py"),
                          {"optimizer.freeze_router": True, "optimizer.warmup_steps": 0}))
    before = jax.device_get(run.state.params)
    routers = router_parameters(cfg, before)
    per_layer = len(routers) // cfg.num_layers
    assert per_layer >= 3 and len(routers) == per_layer * cfg.num_layers, sorted(routers)
    state = run.state
    for i in range(3):
        state, m = run.step_fn(state, run.frozen, run.source.batch(i))
        assert np.isfinite(float(m["loss"]))
    after = router_parameters(cfg, jax.device_get(state.params))
    for p, x in routers.items():
        assert np.array_equal(np.asarray(after[p]), np.asarray(x)), f"{p} moved with freeze_router"
    for i in range(cfg.num_layers):
        for leaf in ("gate_up", "down"):
            assert not np.array_equal(np.asarray(state.params[f"blocks_{i}"]["moe"][leaf]),
                                      np.asarray(before[f"blocks_{i}"]["moe"][leaf]))


def test_sources_are_deterministic_and_resumable(tmp_path):
    import json as _json

    from dgemma_jax.training.data import DataIterator, JsonlSource, RawTextSource

    lay = Layout(prompt_length=6, num_canvases=2, canvas_length=4)
    tok = task_tokenizer()
    path = tmp_path / "sft.jsonl"
    with open(path, "w") as f:
        for i in range(5):
            f.write(_json.dumps({"prompt": f"s{i}{i + 1}=", "response": f"{i}{i + 1}"}) + "\n")
    js = JsonlSource(str(path), tok.encode, lay, batch_size=3, seed=1, bos_id=tok.bos_id)
    seen = [tuple(r) for i in range(5) for r in js.batch(i)["tokens"].tolist()]
    assert len(set(seen[:5])) == 5 and len(set(seen[5:10])) == 5          # each epoch is a permutation
    raw = RawTextSource([tok.encode("0123456789" * 3)], lay, batch_size=4, seed=2, min_prompt=2)
    it = DataIterator(raw)
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    after = next(it)
    it2 = DataIterator(raw)
    it2.set_state(state)
    np.testing.assert_array_equal(next(it2)["tokens"], after["tokens"])
    np.testing.assert_array_equal(DataIterator(raw).__next__()["tokens"], first[0]["tokens"])
    b = first[1]
    assert (b["prompt_lengths"] >= 2).all() and (b["lengths"] <= lay.total_length).all()


def test_remat_same_loss_and_grads(tiny):
    """`remat=True` recomputes each block in the backward pass: same loss and gradients (its memory
    effect shows at scale: the 26B LoRA step in benchmarks/results/aot_26b_lora_*.json)."""
    cfg, params, lay, src = tiny
    batch = {k: jnp.asarray(v) for k, v in src.batch(2).items()}
    obj = ObjectiveConfig(canvas_length=lay.canvas_length, sc_prob=0.5)

    def grad_fn(rt):
        return jax.jit(jax.value_and_grad(lambda p, b, k: loss_fn(p, b, k, config=cfg, obj=obj, runtime=rt)[0]))

    plain, remat = grad_fn(Runtime()), grad_fn(Runtime(remat=True))
    (l0, g0), (l1, g1) = plain(params, batch, jax.random.key(1)), remat(params, batch, jax.random.key(1))
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    # absolute floor at the gradient scale: the last layer's scalar feeds the scale-invariant final
    # norm, so its true gradient is 0 and both computed values are rounding noise
    floor = 1e-5 * max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(g0))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=floor)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_train_cli_on_a_mesh_matches_one_device_and_resumes(tmp_path):
    """`train.mesh` places the parameters in shards and splits the batch: the recipe's losses match
    the single-device run, and a sharded run resumes from its checkpoint into its shardings."""
    import json

    from dgemma_jax.training.train import train

    def run(workdir, steps, mesh=None):
        over = {"train.workdir": str(workdir), "train.num_steps": steps, "train.checkpoint_every": 2,
                "train.export": False}
        if mesh:
            over["train.mesh"] = mesh
        summary = train(load_config(os.path.join(ROOT, "configs", "train_tiny.py"), over))
        rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
        return summary, {r["step"]: r["loss"] for r in rows}

    _, plain = run(tmp_path / "plain", 3)
    summary, sharded = run(tmp_path / "mesh", 3, "fsdp=2,expert=2")
    placed = jax.tree.leaves(summary["run"].state.params)
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated for x in placed)
    for step in (1, 2, 3):
        np.testing.assert_allclose(sharded[step], plain[step], rtol=2e-4)
    _, resumed = run(tmp_path / "mesh", 4, "fsdp=2,expert=2")  # from the step-2 checkpoint
    assert sorted(resumed) == [1, 2, 3, 4] and np.isfinite(resumed[4])
    np.testing.assert_allclose(resumed[3], sharded[3], rtol=1e-5)  # steps 3 re-run from the checkpoint


def test_only_process_zero_writes_the_run_files(tmp_path, monkeypatch):
    """Multi-host: every process trains, but only process 0 writes config / metrics / summary / plot
    (a shared run directory is not written by every host at once); checkpoints and the export are
    orbax's, which every process joins (each writes the shards it holds; see test_training_pod)."""
    import importlib

    train_mod = importlib.import_module("dgemma_jax.training.train")  # the module (the package exports a function)

    over = {"train.num_steps": 2, "train.checkpoint_every": 1, "train.export": True, "train.final_eval": False}
    lead = train_mod.train(load_config(os.path.join(ROOT, "configs", "train_tiny.py"),
                                       {**over, "train.workdir": str(tmp_path / "lead")}))
    monkeypatch.setattr(train_mod, "is_main_process", lambda: False)
    other = train_mod.train(load_config(os.path.join(ROOT, "configs", "train_tiny.py"),
                                        {**over, "train.workdir": str(tmp_path / "other")}))
    written = {p.name for p in (tmp_path / "lead").iterdir()}
    assert {"config.json", "metrics.jsonl", "summary.json", "export", "checkpoints"} <= written
    assert {p.name for p in (tmp_path / "other").iterdir()} == {"checkpoints", "export"}
    for a, b in zip(jax.tree.leaves(other["run"].state.params), jax.tree.leaves(lead["run"].state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same training either way


def test_checkpoint_every_zero_keeps_only_the_final_checkpoint_and_bad_values_are_one_line_errors(tmp_path):
    from dgemma_jax.training.recipe import TrainSection
    from dgemma_jax.training.train import checkpoint_interval, train

    recipe = os.path.join(ROOT, "configs", "train_tiny.py")
    over = {"train.num_steps": 3, "train.export": False, "train.final_eval": False}
    train(load_config(recipe, {**over, "train.checkpoint_every": 0, "train.workdir": str(tmp_path / "run")}))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3"]  # no ZeroDivisionError
    msg = r"train.checkpoint_every must be a whole number of steps >= 0 \(0: only the final checkpoint\), got "
    with pytest.raises(ValueError, match=msg + "-1"):
        train(load_config(recipe, {**over, "train.checkpoint_every": -1, "train.workdir": str(tmp_path / "bad")}))
    assert not (tmp_path / "bad").exists()  # refused before anything was built or written
    for bad in (1.5, "often", None):  # (a recipe may hold any type; --set keeps the recipe's)
        with pytest.raises(ValueError, match=msg + repr(bad)):
            checkpoint_interval(TrainSection(workdir="w", num_steps=1, checkpoint_every=bad))
    assert checkpoint_interval(TrainSection(workdir="w", num_steps=1, checkpoint_every=7.0)) == 7
    assert checkpoint_interval(TrainSection(workdir="w", num_steps=1)) == 500


def test_a_workdir_url_orbax_cannot_write_and_a_pod_without_a_mesh_are_refused(tmp_path, monkeypatch):
    """orbax writes checkpoints to local paths and gs:// only (tests/test_training_pod.py runs gs://):
    any other URL is an error naming the scheme's fix, not a directory named "memory:" on the local disk;
    several processes without train.mesh would each train alone."""
    from dgemma_jax.io.locations import orbax_path
    from dgemma_jax.training.train import train

    assert orbax_path("gs://bkt/run/") == "gs://bkt/run"
    assert orbax_path("rel/dir") == os.path.abspath("rel/dir")
    assert orbax_path("file:///tmp/x") == "/tmp/x"
    recipe = os.path.join(ROOT, "configs", "train_tiny.py")
    monkeypatch.chdir(tmp_path)
    for url in ("memory://run", "s3://bkt/run"):
        with pytest.raises(ValueError, match=r"train.workdir .*: orbax writes to a local directory or a gs:// URL"):
            train(load_config(recipe, {"train.workdir": url}))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"2 processes but no train.mesh.*train.mesh=data="):
        train(load_config(recipe, {"train.workdir": str(tmp_path / "run")}))


def test_warmup_first_update_is_above_zero():
    """The first optimizer update moves the parameters (the warmup starts above 0, not at lr 0);
    the warmup still rises to the peak and the cosine still ends at end_lr."""
    import optax

    opt, sched = make_optimizer(peak_lr=1e-2, end_lr=1e-3, warmup_steps=5, total_steps=40, weight_decay=0.0)
    lrs = np.asarray([float(sched(s)) for s in range(41)])
    assert lrs[0] > 0, lrs[:6]
    assert (np.diff(lrs[:6]) > 0).all() and lrs[5] == pytest.approx(1e-2), lrs[:7]
    assert (np.diff(lrs[5:]) <= 1e-12).all() and lrs[40] == pytest.approx(1e-3)
    params = {"w": jnp.ones((3,))}
    updates, _ = opt.update({"w": jnp.ones((3,))}, opt.init(params), params)
    moved = optax.apply_updates(params, updates)["w"]
    assert (np.asarray(moved) < 1.0).all(), moved
    _, flat = make_optimizer(peak_lr=1e-2, end_lr=1e-3, warmup_steps=0, total_steps=40)
    assert float(flat(0)) == pytest.approx(1e-2)                      # no warmup: the peak at once


def test_eval_overlapping_the_training_data_is_an_error(tmp_path):
    """An eval set drawn like the training data is refused when the run is built: a task eval with
    the training seed (its problems ARE training batch 99's, checked here), the training file as
    eval.path (also through a link), and an eval file sharing an example with the training file. A
    disjoint eval file is accepted and is what the run evaluates on."""
    import json as _json

    from dgemma_jax.training.recipe import DataSection, EvalSection
    from dgemma_jax.training.train import Run

    recipe = os.path.join(ROOT, "configs", "train_tiny.py")
    src = Run(load_config(recipe)).source
    same_seed = Run.__new__(Run)
    same_seed.dc = DataSection(prompt_length=12, num_canvases=3, batch_size=16,
                               tasks=[dict(name="sort", min_len=3, max_len=9)])
    same_seed.ec = EvalSection(seed=0, num_examples=8)
    assert same_seed.eval_pairs() == src.example_strings(99)[:8]      # the overlap is real
    with pytest.raises(ValueError, match=r"eval\.seed 0 equals data\.seed"):
        Run(load_config(recipe, {"eval.seed": 0, "data.seed": 0}))

    def write(name, rows):
        with open(tmp_path / name, "w") as f:
            for p, r in rows:
                f.write(_json.dumps({"prompt": p, "response": r}) + "\n")
        return str(tmp_path / name)

    train_rows = [(f"s{i}{i + 1}{i}=", f"{i}{i}{i + 1}") for i in range(6)]
    train_file = write("train.jsonl", train_rows)
    os.symlink(train_file, tmp_path / "link.jsonl")
    over = {"data.kind": "jsonl", "data.path": train_file}
    for eval_path, msg in ((train_file, "is the training file"), (str(tmp_path / "link.jsonl"), "is the training file"),
                           (write("leaky.jsonl", [("s19=", "19"), train_rows[2]]), "1 of the 2 examples")):
        with pytest.raises(ValueError, match=msg):
            Run(load_config(recipe, {**over, "eval.path": eval_path}))
    held_out = [("s98=", "89"), ("s77=", "77")]
    run = Run(load_config(recipe, {**over, "eval.path": write("held_out.jsonl", held_out)}))
    assert run.eval_pairs() == held_out


def test_the_progress_bar_starts_after_the_step_compiles(tmp_path, capsys):
    """issue 46: the bar sat at 0 through the compile and its ETA counted the compile as a step (a
    31-minute ETA for an 82 s run); now a line says the step is compiling and the bar starts after the
    first step, at step 1."""
    from dgemma_jax.training.train import train

    over = {"train.workdir": str(tmp_path), "train.num_steps": 3, "train.export": False, "train.progress": True}
    train(load_config(os.path.join(ROOT, "configs", "train_tiny.py"), over))
    err = capsys.readouterr().err
    at = err.index("train: compiling the train step")
    bar = err[at:].split("\n", 1)[1]
    assert "train:" in bar and "0/3" not in bar and "1/3" in bar, err
