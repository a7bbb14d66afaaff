"""Full fine-tuning (all weights except the router) with the published optimizer recipe.

Defaults target the released 26B-A4B (set init.path and the data paths); for a quick local run
point init at the bundled model: init.kind="bundled" with data.kind="tasks" (see train_bundled.py).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(preset="", param_dtype="bfloat16",
                                             overrides=dict(canvas_length=256, dtype="bfloat16")))
    c.init = ml_collections.ConfigDict(dict(kind="hf", path="/path/to/diffusiongemma-26B-A4B-it"))
    c.data = ml_collections.ConfigDict(dict(
        kind="jsonl", path="/path/to/train.jsonl", tokenizer="hf",
        tokenizer_path="/path/to/diffusiongemma-26B-A4B-it/tokenizer.json", bos_id=None,
        prompt_length=256, num_canvases=1, batch_size=16, seed=0))
    c.objective = ml_collections.ConfigDict(dict(t_eps=1e-3, sc_prob=0.5, ar_weight=1.0, ar_on_prompt=True,
                                                 weighting="none"))
    c.optimizer = ml_collections.ConfigDict(dict(
        peak_lr=1.5e-4, end_lr=1.5e-5, warmup_steps=100, b1=0.95, b2=0.99, eps=1e-8, weight_decay=1e-4,
        clip_norm=1.0, freeze_router=True))
    c.lora = ml_collections.ConfigDict(dict(enabled=False, rank=8, alpha=8.0, groups=("attention",)))
    c.train = ml_collections.ConfigDict(dict(
        workdir="/tmp/dgemma_full_ft", num_steps=2000, seed=0, log_every=10, checkpoint_every=250,
        eval_every=0, max_to_keep=3, export=True, progress=True, final_eval=False))
    c.eval = ml_collections.ConfigDict(dict())
    return c
