"""The typed training recipe (`training.recipe.TrainConfig`): built once, unknown keys refused by itself."""

import glob
import os

import ml_collections
import pytest

from dgemma_jax.training.recipe import DataSection, EvalSection, TrainConfig, TrainSection, section_keys
from dgemma_jax.training.train import load_config, recipe_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_shipped_recipe_builds_its_typed_config(path):
    typed = TrainConfig.from_recipe(load_config(path))
    assert isinstance(typed.data, DataSection) and isinstance(typed.train, TrainSection)
    raw = load_config(path)
    assert typed.train.num_steps == raw.train.num_steps and typed.data.batch_size == raw.data.batch_size
    assert (typed.eval is None) == (not raw.eval.to_dict())  # an empty eval section: no evaluation


def _tiny():
    return load_config(os.path.join(ROOT, "configs", "train_tiny.py"))


def test_a_key_no_section_reads_is_refused_with_the_nearest_one():
    cfg = _tiny()
    cfg.train.num_stepz = 10  # written into the recipe itself, not through an override
    with pytest.raises(ValueError, match=r"unknown recipe key train.num_stepz; did you mean train.'num_steps'\?"):
        TrainConfig.from_recipe(cfg)
    cfg = _tiny()
    cfg.optimizer.peak_lrr = 1e-3
    with pytest.raises(ValueError, match=r"unknown recipe key optimizer.peak_lrr; did you mean optimizer.'peak_lr'"):
        TrainConfig.from_recipe(cfg)
    cfg = _tiny()
    cfg.evaluation = ml_collections.ConfigDict({"seed": 3})
    with pytest.raises(ValueError, match=r"unknown recipe key recipe.evaluation"):
        TrainConfig.from_recipe(cfg)


def test_defaults_live_in_the_sections_and_required_keys_are_named():
    cfg = _tiny()
    del cfg.train["log_every"]
    typed = TrainConfig.from_recipe(cfg)
    assert typed.train.log_every == TrainSection.__dataclass_fields__["log_every"].default == 10
    assert typed.eval == EvalSection(num_examples=8, batch_size=8, seed=1, sampler={"max_denoising_steps": 4})
    cfg = _tiny()
    del cfg.data["batch_size"]
    with pytest.raises(ValueError, match=r"the recipe's data section needs data.batch_size"):
        TrainConfig.from_recipe(cfg)


def test_the_override_keys_are_the_typed_sections():
    keys = recipe_keys(_tiny())
    for section, names in section_keys().items():
        assert {f"{section}.{n}" for n in names} <= keys
    assert "data.markers" in keys and "init.vision_from_scratch" in keys and "eval.sampler.t_max" in keys
    with pytest.raises(ValueError, match="unknown config key 'data.batchsize'"):
        load_config(os.path.join(ROOT, "configs", "train_tiny.py"), {"data.batchsize": 4})
