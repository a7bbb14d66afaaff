"""A Hugging Face checkpoint's image processor decides the soft tokens per image (issue 36, point 2).

The reference: tests/golden/processor_budget.json, made by transformers 5.23's `Gemma4ImageProcessorPil`
loaded from a saved preprocessor_config.json (`python -m tests.golden.processor_budget_case`, no torch
needed). Here that file goes into a checkpoint directory and the count per image, with no override,
must be transformers' exactly.
"""

import json
import os

import jax
import numpy as np
import pytest

from dgemma_jax.config import ModelConfig, VisionConfig
from dgemma_jax.io.hf import load_hf, save_hf
from dgemma_jax.io.images import preprocess_images, settings_for
from dgemma_jax.model.api import param_shapes

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "processor_budget.json")
CASES = json.load(open(FIXTURE))["cases"]
TOWER = VisionConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                     patch_size=16, pooling_kernel_size=3, position_embedding_size=64)


def _checkpoint(path, processor: dict | None):
    """A Hugging Face directory (config.json with this vision tower, zero weights) and its processor file."""
    cfg = ModelConfig.preset("tiny-2layer", vision=TOWER, image_token_id=5, boi_token_id=6, eoi_token_id=7)
    save_hf(jax.tree.map(lambda s: np.zeros(s.shape, np.float32), param_shapes(cfg)), cfg, path)
    if processor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


@pytest.mark.parametrize("case", CASES, ids=[f"max_soft_tokens={c['preprocessor_config']['max_soft_tokens']}"
                                             for c in CASES])
def test_the_checkpoints_processor_gives_transformers_soft_tokens_per_image(tmp_path, case):
    path = _checkpoint(tmp_path, case["preprocessor_config"])
    budget = case["preprocessor_config"]["max_soft_tokens"]
    loaded, _ = load_hf(path)                      # the loading path (from_pretrained, load_checkpoint, serve)
    assert loaded.vision.default_soft_tokens == ModelConfig.from_hf(path).vision.default_soft_tokens == budget
    settings = settings_for(loaded)                # what an image prompt without max_soft_tokens uses
    for size, want in case["soft_tokens"].items():
        h, w = (int(x) for x in size.split("x"))
        got = int(preprocess_images(np.zeros((h, w, 3), np.uint8), settings).soft_tokens[0])
        assert got == want, (size, got, want)


def test_without_a_processor_file_the_budget_is_the_default(tmp_path):
    assert ModelConfig.from_hf(_checkpoint(tmp_path, None)).vision.default_soft_tokens == 280


def test_a_processor_of_another_patch_size_is_refused(tmp_path):
    path = _checkpoint(tmp_path, dict(CASES[0]["preprocessor_config"], patch_size=14))
    with pytest.raises(ValueError, match=r"image processor .* uses patch 14, pooling 3 but config.json's vision "
                                         r"tower patch 16, pooling 3"):
        ModelConfig.from_hf(path)
