"""NaN/Inf in the weights: every load path refuses a checkpoint holding one and names the tensor; a model
poisoned after loading gives a per-row `nonfinite` flag (fused generate, the streaming drivers, the
server's slot round) and a warning or an error at the API level, not silent pad text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dgemma_jax as dg
from dgemma_jax.config import ModelConfig
from dgemma_jax.engine import Engine
from dgemma_jax.engine.drivers import collect
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.errors import DgemmaWarning, NonFiniteLogits
from dgemma_jax.io.finite import first_nonfinite
from dgemma_jax.io.hf import save_hf
from dgemma_jax.io.model_dir import load_model, save_model
from dgemma_jax.pipeline import DiffusionGemma
from dgemma_jax.sampling import slots as slots_lib
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import RowKnobs, row_keys
from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json

CFG = ModelConfig.preset("tiny-2layer")
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=3, eos_ids=(1,))


@pytest.fixture(scope="module")
def params():
    return dg.init_params(CFG, 0)


def _poison(params, path, index=0):
    """params with one NaN at flat position `index` of the leaf at `path` (a tuple of keys)."""
    def f(kp, x):
        if tuple(getattr(k, "key", k) for k in kp) != path:
            return x
        return x.reshape(-1).at[index].set(jnp.nan).reshape(x.shape)
    return jax.tree_util.tree_map_with_path(f, params)


def _hf_dir(tmp_path, params, poison: str | None, index: int = 5):
    save_hf(params, CFG, tmp_path)
    if poison:
        file = str(tmp_path / "model.safetensors")
        tensors = load_file(file)
        t = tensors[poison].copy()
        t.reshape(-1)[index] = np.nan
        tensors[poison] = t
        save_file(tensors, file, metadata={"format": "pt"})
    return tmp_path


def test_a_clean_checkpoint_loads(tmp_path, params):
    cfg, loaded, _ = load_model(_hf_dir(tmp_path, params, None))
    assert first_nonfinite(loaded) is None


@pytest.mark.parametrize("name", ["model.decoder.layers.1.self_attn.q_proj.weight",
                                  "model.decoder.layers.0.mlp.up_proj.weight"])  # the second: one half of a stacked leaf
def test_a_safetensors_checkpoint_with_one_nan_is_refused_naming_the_tensor(tmp_path, params, name):
    if name not in load_file(str(_hf_dir(tmp_path, params, None) / "model.safetensors")):
        pytest.skip(f"{name} is not in this preset")
    path = _hf_dir(tmp_path, params, name)
    with pytest.raises(ValueError, match=rf"tensor '{name}' holds 1 NaN and 0 Inf value\(s\).*re-download"):
        load_model(path)


def test_an_orbax_checkpoint_with_inf_is_refused_naming_the_tensor(tmp_path, params):
    bad = jax.tree_util.tree_map_with_path(
        lambda kp, x: x.at[(0,) * x.ndim].set(jnp.inf) if "/".join(k.key for k in kp) == "blocks_1/attn/o" else x,
        params)
    save_model(tmp_path / "m", CFG, bad, SAMPLER)
    with pytest.raises(ValueError, match=r"tensor 'blocks_1/attn/o' holds 0 NaN and 1 Inf value\(s\)"):
        load_model(tmp_path / "m")


def test_the_pipeline_refuses_a_poisoned_checkpoint_in_one_line(tmp_path, params):
    gemma_like_tokenizer_json(tmp_path / "tokenizer.json")
    save_model(tmp_path / "m", CFG, _poison(params, ("final_norm", "scale")), SAMPLER,
               tokenizer_file=str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError) as e:
        DiffusionGemma.from_pretrained(str(tmp_path / "m"))
    assert "'final_norm/scale' holds 1 NaN" in str(e.value) and "\n" not in str(e.value)


PROMPTS = np.array([[2, 5, 6, 7], [2, 9, 10, 0]], np.int32), np.array([4, 3], np.int32)


@pytest.mark.parametrize("where", [("blocks_0", "attn", "q"), ("embedding",)])  # NaN hidden states / one NaN row
def test_a_poisoned_model_gives_the_flag_and_a_warning_not_silent_pad(params, where):
    eng = Engine(CFG, _poison(params, where, index=CFG.hidden_size * 7), SAMPLER, compilation_cache=False)
    with pytest.warns(DgemmaWarning, match=r"NaN/Inf logits for row\(s\) \[0, 1\]"):
        out = eng.generate(*PROMPTS, max_new_tokens=16)
    assert np.asarray(out.nonfinite).tolist() == [True, True]
    with pytest.raises(NonFiniteLogits, match="not its answer"):
        eng.generate(*PROMPTS, max_new_tokens=16, nonfinite="raise")
    with pytest.warns(DgemmaWarning, match="NaN/Inf logits"):
        events = list(eng.stream(*PROMPTS, max_new_tokens=16))
    assert events[0].nonfinite.tolist() == [True, True]
    with pytest.warns(DgemmaWarning, match="NaN/Inf logits"):
        canvases = [e for e in eng.steps(*PROMPTS, max_new_tokens=16) if hasattr(e, "nonfinite")]
    assert canvases[0].nonfinite.all()


def test_a_clean_model_raises_no_flag(params):
    import warnings
    eng = Engine(CFG, params, SAMPLER, compilation_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DgemmaWarning)
        out = eng.generate(*PROMPTS, max_new_tokens=16)
        toks, _, _ = collect(eng.stream(*PROMPTS, max_new_tokens=16), 2, 16, 16, 0)
    assert not np.asarray(out.nonfinite).any()
    np.testing.assert_array_equal(toks, np.asarray(out.tokens))


def test_the_server_tick_flags_the_poisoned_slots(params):
    bad = _poison(params, ("blocks_0", "attn", "q"))
    engine = Engine(CFG, bad, SAMPLER, compilation_cache=False)
    cache, state = engine.new_cache(2, 32), engine.new_slots(2)
    knobs = RowKnobs.from_samplers([SAMPLER, SAMPLER], SAMPLER.max_denoising_steps)

    @jax.jit
    def tick(p, cache, state, keys):
        cache = slots_lib.prefill_slot(p, CFG, cache, jnp.int32(0), jnp.asarray(PROMPTS[0][:1]), jnp.asarray([4]),
                                       jnp.int32(0))
        on = jnp.array([True, False])
        off = jnp.array([False, False])
        return slots_lib.slot_tick(p, CFG, SAMPLER, cache, state, keys, jnp.zeros((2,), jnp.int32), on, on, off,
                                   off, knobs, jnp.int32(1))
    out = tick(bad, cache, state, row_keys(0, 2))
    assert np.asarray(out.nonfinite).tolist() == [True, False]  # an idle slot is not flagged


def test_the_text_api_raises_instead_of_answering_pad(params):
    tok = CharTokenizer("0123456789+=")
    dgm = DiffusionGemma(CFG, _poison(params, ("embedding",)), tok, SAMPLER, compilation_cache=False)
    with pytest.raises(NonFiniteLogits, match=r"row\(s\) \[0\]"):
        dgm.generate("1+2=", max_new_tokens=16)
