"""A seconds-long recipe on a 2-layer model (one sliding + one global layer): tests and smoke runs."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        preset="",
        overrides=dict(
            vocab_size=18, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, num_kv_heads=1,
            global_head_dim=16, num_global_kv_heads=1, intermediate_size=32, num_experts=4, top_k=2,
            moe_intermediate_size=16, sliding_window=4, canvas_length=4, max_position_embeddings=64,
            layer_types=("sliding", "global"), eos_ids=(1,), name="tiny-test"),
    ))
    c.init = ml_collections.ConfigDict(dict(kind="random", seed=0, embedding_std=0.18))
    c.data = ml_collections.ConfigDict(dict(
        kind="tasks", tokenizer="tasks", tasks=[dict(name="sort", min_len=3, max_len=9)],
        prompt_length=12, num_canvases=3, batch_size=16, seed=0))
    c.objective = ml_collections.ConfigDict(dict(t_eps=1e-3, sc_prob=0.5, ar_weight=1.0, ar_on_prompt=True,
                                                 weighting="none"))
    c.optimizer = ml_collections.ConfigDict(dict(peak_lr=1e-2, end_lr=1e-3, warmup_steps=5, weight_decay=1e-4,
                                                 clip_norm=1.0, freeze_router=True))
    c.lora = ml_collections.ConfigDict(dict(enabled=False, rank=4, alpha=4.0, groups=("attention", "mlp")))
    c.train = ml_collections.ConfigDict(dict(
        workdir="/tmp/dgemma_tiny", num_steps=40, seed=0, log_every=1, checkpoint_every=5, eval_every=0,
        max_to_keep=None, export=True, progress=False, final_eval=False, throttle_s=0.0,
        compilation_cache_dir=""))
    c.eval = ml_collections.ConfigDict(dict(num_examples=8, batch_size=8, seed=1, sampler=dict(max_denoising_steps=4)))
    return c
