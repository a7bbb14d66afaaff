"""LoRA adapters served beside one base model (`dgemma serve --lora NAME=PATH`), taken by the library
(`DiffusionGemma(lora=)`) and `dgemma generate --lora`: the per-row adapter math, the adapter reader,
and the server through the `openai` client."""

import concurrent.futures as cf
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import openai
import optax
import pytest

from dgemma_jax import DiffusionGemma, ModelConfig, init_params
from dgemma_jax.io.bundled import load_bundled
from dgemma_jax.model import api
from dgemma_jax.model.cache import init_cache
from dgemma_jax.model.layers import low_rank
from dgemma_jax.training import adapters as adapters_lib
from dgemma_jax.training import lora as lora_lib
from dgemma_jax.training.checkpoint import Checkpointer
from dgemma_jax.training.step import init_train_state
from tests.helpers.serve import ServerProcess

MODEL = "dgemma-tiny-digits"
pytestmark = pytest.mark.slow   # bundled-model compiles and real servers: tens of seconds each


def save_adapter(workdir, cfg, params, seed: int, rank: int = 4, alpha: float = 8.0, groups=("attention", "mlp"),
                 b_std: float = 0.1, step: int = 5):
    """A LoRA run's work directory as `dgemma train` leaves it: config.json (the recipe, its lora
    section) and checkpoints/<step>/state (the adapters as the state's params, with their optimizer
    state), written by the trainer's own Checkpointer. B is random (a trained adapter is nonzero)."""
    tree = lora_lib.init_lora(cfg, params, jax.random.key(seed), rank, groups)
    leaves = lora_lib._lora_leaves(tree)
    for i, (p, ab) in enumerate(sorted(leaves.items())):
        ab["b"] = jax.random.normal(jax.random.fold_in(jax.random.key(seed + 100), i), ab["b"].shape) * b_std
    state = init_train_state(tree, optax.adamw(1e-3), seed)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps({
        "model": {"preset": None}, "init": {"kind": "bundled", "name": cfg.name},
        "lora": {"enabled": True, "rank": rank, "alpha": alpha, "groups": list(groups)},
        "train": {"workdir": str(workdir), "num_steps": step}}))
    ckpt = Checkpointer(workdir / "checkpoints")
    ckpt.save(step, state, {"index": step}, force=True)
    ckpt.close()
    return tree


# ---------------------------------------------------------------------------- the model's math
def test_per_row_adapters_equal_each_adapter_alone(tmp_path):
    """Rows of one batch each running their own adapter (stacked, gathered per row; row 0 the zero
    adapter) give each row what that adapter alone gives it, and the base rows what the base gives.
    The bundled model has the whole code path (MoE with a shared MLP, sliding and global layers,
    self-conditioning); the two adapters differ in rank, so one is zero-padded in the stack."""
    cfg, params, _, _ = load_bundled(MODEL)
    trees = [save_adapter(tmp_path / f"a{i}", cfg, params, seed=i + 1, rank=2 + 2 * i) for i in range(2)]
    ads = [adapters_lib.load_adapter(str(tmp_path / f"a{i}"), cfg) for i in range(2)]
    for tree, ad in zip(trees, ads):   # read back exactly as saved
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ad.tree, tree)
    stacked = adapters_lib.stack(cfg, ads)
    rows = jnp.array([0, 1, 2, 1], jnp.int32)
    b, t = 4, 6
    tokens = jax.random.randint(jax.random.key(0), (b, t), 1, cfg.vocab_size)
    canvas = jax.random.randint(jax.random.key(1), (b, cfg.canvas_length), 1, cfg.vocab_size)

    @jax.jit
    def run(p, tok, can):
        cache = init_cache(cfg, tok.shape[0], t + 2)
        _, cache = api.encode_pass(p, cfg, tok, cache.lengths, jnp.full((tok.shape[0],), t, jnp.int32), cache)
        return api.denoise_logits(p, cfg, can, cache.lengths, cache)

    mixed = np.asarray(run(api.with_adapters(params, stacked, rows), tokens, canvas))
    alone = [np.asarray(run(params, tokens, canvas))] + [
        np.asarray(run(api.with_adapters(params, adapters_lib.single(cfg, ad)), tokens, canvas)) for ad in ads]
    for i, r in enumerate(np.asarray(rows)):   # bit for bit
        np.testing.assert_array_equal(mixed[i], alone[r][i])
    assert np.abs(alone[1] - alone[0]).max() > 1e-2 and np.abs(alone[2] - alone[1]).max() > 1e-2


def test_adapter_reader_names_the_problem(tmp_path):
    cfg, params, _, _ = load_bundled(MODEL)
    with pytest.raises(ValueError, match="no such directory"):
        adapters_lib.load_adapter(str(tmp_path / "missing"), cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint in it"):
        adapters_lib.load_adapter(str(tmp_path / "empty"), cfg)
    save_adapter(tmp_path / "full", cfg, params, seed=1)
    recipe = json.loads((tmp_path / "full" / "config.json").read_text())
    recipe["lora"]["enabled"] = False
    (tmp_path / "full" / "config.json").write_text(json.dumps(recipe))
    with pytest.raises(ValueError, match="not a LoRA run"):
        adapters_lib.load_adapter(str(tmp_path / "full"), cfg)
    other = ModelConfig.preset("tiny-6layer")
    save_adapter(tmp_path / "other", other, init_params(other, 0), seed=1)
    with pytest.raises(ValueError, match="does not fit dgemma-tiny-digits"):
        adapters_lib.load_adapter(str(tmp_path / "other"), cfg)
    # one checkpoints/<step> directory is an adapter too
    save_adapter(tmp_path / "run", cfg, params, seed=2, step=7)
    ad = adapters_lib.load_adapter(str(tmp_path / "run" / "checkpoints" / "7"), cfg)
    assert (ad.rank, ad.alpha, ad.groups) == (4, 8.0, ("attention", "mlp"))
    exp = save_adapter(tmp_path / "experts", other, init_params(other, 0), seed=3, groups=("experts",))
    assert exp
    with pytest.raises(ValueError, match="experts group"):
        adapters_lib.stack(other, [adapters_lib.load_adapter(str(tmp_path / "experts"), other)])


def test_lora_flag_errors_are_one_line_exit_2(tmp_path):
    def dgemma(*args):
        return subprocess.run([sys.executable, "-m", "dgemma_jax.cli", *args], capture_output=True, text=True,
                              timeout=300)

    for spec, why in [("noequals", "expected NAME=PATH"), ("=x", "expected NAME=PATH"),
                      (f"a={tmp_path / 'missing'}", "is no directory")]:
        r = dgemma("serve", "--port", "0", "--lora", spec)
        assert r.returncode == 2 and r.stderr.startswith("dgemma: error:") and why in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    for command in (("generate", "--prompt", "s21="), ("chat",)):   # refused before the model loads
        r = dgemma(*command, "--lora", str(tmp_path / "empty"))
        assert r.returncode == 2 and r.stderr.startswith("dgemma: error: --lora") and "no checkpoint" in r.stderr, \
            r.stderr
        assert "loading" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------- the server
PROMPTS = ["s9350814272=", "s31415926535=", "s705182936="]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    cfg, params, _, _ = load_bundled(MODEL)
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(root / "one", cfg, params, seed=11, rank=4)
    # rank 2, attention only: stacked beside "one", it is zero-padded to rank 4 and zero on the MLPs
    save_adapter(root / "two", cfg, params, seed=22, rank=2, groups=("attention",), b_std=0.2)
    return str(root / "one"), str(root / "two")


SERVE = ("--slots", "4", "--context", "64", "--max-steps", "16", "--no-prefix-reuse")


def _answers(client, model: str, seeds=(0, 1)):
    return [client.completions.create(model=model, prompt=p, seed=s, max_tokens=16) for p in PROMPTS for s in seeds]


@pytest.fixture(scope="module")
def served(adapter_dirs):
    """What three servers answered: one holding both adapters beside the base (the three models'
    requests sent concurrently, so that their rows share ticks, then each request alone), and one
    server per adapter holding that adapter alone."""
    one, two = adapter_dirs
    out: dict = {}
    both = ServerProcess(*SERVE, "--lora", f"one={one}", "--lora", f"two={two}")
    try:
        client = both.client()
        out["models"] = [m.model_dump() for m in client.models.list().data]
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="three", prompt=PROMPTS[0], max_tokens=8)
        out["unknown"] = (e.value.status_code, e.value.body)
        with cf.ThreadPoolExecutor(3) as pool:
            futs = {m: pool.submit(_answers, client, m) for m in (MODEL, "one", "two")}
            out["mixed"] = {m: f.result() for m, f in futs.items()}
        out["sequential"] = {m: [r.choices[0].text for r in _answers(client, m)] for m in (MODEL, "one", "two")}
    finally:
        both.stop()
    out["alone"] = {}
    for name, path in (("one", one), ("two", two)):
        alone = ServerProcess(*SERVE, "--lora", f"{name}={path}")
        try:
            out["alone"][name] = [r.choices[0].text for r in _answers(alone.client(), name)]
        finally:
            alone.stop()
    return out


def test_two_adapters_and_the_base_answer_differently_in_one_batch(served):
    models = served["models"]
    assert [m["id"] for m in models] == [MODEL, "one", "two"]
    assert [m.get("parent") for m in models] == [None, MODEL, MODEL]
    status, err = served["unknown"]
    assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "invalid_request_error"            # OpenAI's error object
    assert "'three' does not exist" in err["message"] and "'one'" in err["message"]
    mixed = served["mixed"]
    texts = {m: [r.choices[0].text for r in rs] for m, rs in mixed.items()}
    assert all(r.model == m for m, rs in mixed.items() for r in rs)
    ranges = {m: [r.usage.model_extra["tick_range"] for r in rs] for m, rs in mixed.items()}
    shared = [(m, n) for m in ranges for n in ranges if m < n and any(
        max(x[0], y[0]) <= min(x[1], y[1]) for x in ranges[m] for y in ranges[n])]
    assert len(shared) == 3, ranges                         # every two models' rows ran in some same ticks
    assert texts[MODEL] != texts["one"] and texts["one"] != texts["two"] and texts[MODEL] != texts["two"]
    # the base rows still sort the digits (the zero adapter changes nothing)
    assert texts[MODEL] == ["".join(sorted(p[1:-1])) for p in PROMPTS for _ in (0, 1)]
    assert texts[MODEL] == served["sequential"][MODEL]


def test_each_adapter_alone_on_the_mixed_server_equals_its_own_server(served):
    """Stacked beside another adapter (zero-padded in rank, zero on the kernels it does not adapt) an
    adapter answers bit for bit as on a server holding it alone."""
    for name in ("one", "two"):
        assert served["sequential"][name] == served["alone"][name], name


def test_each_model_in_the_concurrent_batch_equals_its_requests_alone(served):
    """Each model's rows in the mixed batch give what its requests give one at a time: per-row adapters
    follow the rows into every pass, the commit of a settled canvas (a pass over some rows) too."""
    texts = {m: [r.choices[0].text for r in rs] for m, rs in served["mixed"].items()}
    assert texts == served["sequential"]


def test_a_pass_over_other_rows_than_the_indices_is_refused():
    x = jnp.ones((1, 3, 4))
    ab = {"a": jnp.ones((3, 4, 2)), "b": jnp.ones((3, 2, 5)), "rows": jnp.array([0, 1, 2, 1])}
    with pytest.raises(ValueError, match="4 row indices for a batch of 1 rows"):
        low_rank("btd,df->btf", x, ab)
    ab["rows"] = jnp.array([2])
    np.testing.assert_allclose(low_rank("btd,df->btf", x, ab), np.full((1, 3, 5), 8.0))


def test_library_and_cli_take_an_adapter_the_same_way(adapter_dirs):
    """`DiffusionGemma(lora=PATH)` and `dgemma generate --lora PATH` run the adapter unmerged: the same
    text, not the base model's."""
    one, _ = adapter_dirs
    prompt = PROMPTS[1]
    lib = DiffusionGemma.from_pretrained(lora=one).generate(prompt, max_new_tokens=16, seed=3)
    base = DiffusionGemma.from_pretrained().generate(prompt, max_new_tokens=16, seed=3)
    r = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "generate", "--prompt", prompt, "--max-new-tokens",
                        "16", "--seed", "3", "--quiet", "--lora", one], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == lib != base == "".join(sorted(prompt[1:-1]))
