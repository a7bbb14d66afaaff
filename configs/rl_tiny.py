"""A seconds-long GRPO recipe on the 2-layer test model (configs/train_tiny.py's): tests and smoke runs.

Rollouts of the sort task (G = 4 per prompt), a dense reward (characters right), 2 updates per rollout
batch with the clipped surrogate and a KL against the initial weights.
"""

import importlib.util
import os

import ml_collections


def get_config():
    spec = importlib.util.spec_from_file_location("_train_tiny", os.path.join(os.path.dirname(__file__), "train_tiny.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    c = tiny.get_config()
    c.data.batch_size = 2
    c.rl = ml_collections.ConfigDict(dict(
        algorithm="grpo", group_size=4, reward="dgemma_jax.training.rewards:char_accuracy", num_samples=1,
        updates_per_rollout=2, clip_eps=0.2, kl_beta=0.04, t_eps=1e-3, sampler=dict(max_denoising_steps=4)))
    c.train.workdir = "/tmp/dgemma_rl_tiny"
    c.train.num_steps = 6
    c.train.checkpoint_every = 2
    c.train.export = False
    c.eval = ml_collections.ConfigDict()
    return c
