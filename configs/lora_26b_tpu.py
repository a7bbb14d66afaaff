"""LoRA SFT of the released DiffusionGemma 26B-A4B on a TPU slice (e.g. v5p-8 / v6e-8).

Published recipe (spec §4.5): LoRA on attention + dense MLP (TRL's targets; experts, router and the
self-conditioning block frozen), Adam(0.95, 0.99, eps 1e-8), weight decay 1e-4, clip 1.0, warmup 100
then cosine 1.5e-4 -> 1.5e-5, t ~ U(1e-3, 1), self-conditioning prob 0.5, encoder AR loss weight 1,
canvases of 256. Data: a JSON-lines file of {"prompt": ..., "response": ...} rendered with the
chat template (prompt text should already contain the template and BOS; set bos_id otherwise).

The train step takes in/out shardings (dgemma_jax.training.step.make_train_step); the driver that
builds the mesh is the lead's `dgemma train` CLI. Set init.path, data.path, data.tokenizer_path. On a
slice of several hosts set train.workdir to a gs:// URL (one directory every host sees; docs/training.md,
"training on pods").

Fit, checked with the TPU compiler (benchmarks/results/aot_26b_lora_v5p-8.json): batch 8 x 1280
tokens on v5p-8 with mesh expert=4 and the "training" rules, remat on, needs 36.3 of 95.7 GB per
chip (unmerged LoRA; 42.8 GB when the adapters were merged every step). Reproduce:
dgemma compile --preset diffusiongemma-26b-a4b --topology v5p-8 --mesh expert=4 --rules training
--batch 8 --context 1280 --prompt 1024 --programs lora_step
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(preset="", param_dtype="bfloat16",
                                             overrides=dict(canvas_length=256, dtype="bfloat16", remat=True)))
    c.init = ml_collections.ConfigDict(dict(kind="hf", path="/path/to/diffusiongemma-26B-A4B-it"))
    c.data = ml_collections.ConfigDict(dict(
        kind="jsonl", path="/path/to/train.jsonl", tokenizer="hf",
        tokenizer_path="/path/to/diffusiongemma-26B-A4B-it/tokenizer.json", bos_id=None,
        prompt_length=768, num_canvases=2, batch_size=8, seed=0))
    c.objective = ml_collections.ConfigDict(dict(t_eps=1e-3, sc_prob=0.5, ar_weight=1.0, ar_on_prompt=True,
                                                 weighting="none"))
    c.optimizer = ml_collections.ConfigDict(dict(
        peak_lr=1.5e-4, end_lr=1.5e-5, warmup_steps=100, b1=0.95, b2=0.99, eps=1e-8, weight_decay=1e-4,
        clip_norm=1.0))
    c.lora = ml_collections.ConfigDict(dict(enabled=True, rank=16, alpha=32.0, groups=("attention", "mlp")))
    c.train = ml_collections.ConfigDict(dict(
        workdir="/tmp/dgemma_lora_26b", num_steps=2000, seed=0, log_every=10, checkpoint_every=250,
        eval_every=0, max_to_keep=3, export=True, progress=True, final_eval=False))
    c.eval = ml_collections.ConfigDict(dict())
    return c
