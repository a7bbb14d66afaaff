"""GRPO on the bundled image model (dgemma_jax/assets/dgemma-tiny-vision-digits): exact-match reward on
"sort the digits in the image", with "read the digits in the image" in the mix so reading holds.

    python scripts/rl_vision_bundled.py            # trains this recipe, evaluates, plots (CPU)
    dgemma train --config configs/rl_vision_digits.py   # the training alone

Full fine-tuning of the 447k parameters (tower included) from the bundled weights, against a frozen copy
of them (k3 KL, kl_beta). Each step: data.batch_size pictures (new ones: data.seed 3; the held-out
pictures come from the eval seed's stream), each rolled out group_size times with the released sampler
settings (the ones the accuracy is measured with), reward 1 for the exact answer else 0, group-relative
advantages, updates_per_rollout optimizer steps on the clipped surrogate; likelihoods from
`likelihood.token_logprobs` (num_samples stratified noise draws per canvas, shared by policy, old
policy and reference) with the picture through the tower. Dynamic sampling (rl.skip_equal_groups): most
groups of the bundled model are all correct (no gradient); each step rolls out up to rl.max_rounds batches
of pictures and updates on the groups whose rewards differ (`rl.GRPOStep`).
"""

import ml_collections

SORT = "sort the digits in the image"
READ = "read the digits in the image"
SAMPLER = dict(max_denoising_steps=16, t_max=0.8, t_min=0.4, entropy_bound=0.1, confidence_threshold=0.005,
               stability_threshold=1)


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(preset="", overrides={}))
    c.init = ml_collections.ConfigDict(dict(kind="bundled", name="dgemma-tiny-vision-digits"))
    c.data = ml_collections.ConfigDict(dict(
        kind="image_tasks", tokenizer="image_tasks",
        image_tasks=[dict(op="sort", prompt=SORT, min_len=4, max_len=6, weight=3.0),
                     dict(op="read", prompt=READ, min_len=4, max_len=6, weight=1.0)],
        prompt_length=104, num_canvases=1, batch_size=16, seed=3,
    ))
    c.objective = ml_collections.ConfigDict()
    c.optimizer = ml_collections.ConfigDict(dict(
        peak_lr=2e-4, end_lr=2e-5, warmup_steps=5, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.0,
        clip_norm=1.0, freeze_router=True))
    c.lora = ml_collections.ConfigDict(dict(enabled=False, rank=8, alpha=8.0, groups=("attention",)))
    c.rl = ml_collections.ConfigDict(dict(
        algorithm="grpo", group_size=8, reward="dgemma_jax.training.rewards:exact_match", num_samples=2,
        updates_per_rollout=2, clip_eps=0.2, kl_beta=0.01, t_eps=1e-3, sampler=SAMPLER,
        skip_equal_groups=True, max_rounds=4))
    c.train = ml_collections.ConfigDict(dict(
        workdir="/tmp/dgemma_rl_vision", num_steps=300, seed=0, log_every=5, checkpoint_every=50,
        eval_every=25, max_to_keep=1, time_limit_s=1800, export=True, progress=False, final_eval=True))
    c.eval = ml_collections.ConfigDict(dict(num_examples=200, batch_size=100, seed=12345, sampler=SAMPLER))
    return c
