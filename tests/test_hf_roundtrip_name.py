"""save_hf then load_hf gives back the config it saved, its name included (issue 46: the name came back
as "hf", so a model saved and reloaded compiled every program again: the config is part of their key)."""

import dgemma_jax as dg


def test_save_hf_then_load_hf_keeps_the_config_and_its_name(tmp_path):
    config = dg.ModelConfig.preset("tiny-2layer")
    dg.save_hf(dg.init_params(config, 0), config, str(tmp_path))
    loaded, _ = dg.load_hf(str(tmp_path))
    assert loaded.name == config.name == "tiny-2layer"
    assert loaded == config
