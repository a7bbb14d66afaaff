"""From-scratch CPU recipe: the bundled image model (dgemma_jax/assets/dgemma-tiny-vision-digits/).

A small DiffusionGemma-architecture model with a Gemma 4 vision tower (the same code path as the
released model: patch embedder with 2D positions, axial RoPE encoder layers, the pooler, the
projection into the text width, image tokens attended bidirectionally in the encoder) learns to read
4-6 digits drawn by Pillow into a 1120 x 16 strip, one digit per 16-pixel cell from the left edge
(dgemma_jax/training/image_tasks.py), and to answer "sort the digits in the image" (half of the mix)
and "read the digits in the image" (the other half, which teaches the reading directly). Everything
trains from scratch, the tower included. Reproduce with `python scripts/train_vision_bundled.py --fresh`.

Each picture is 70 soft tokens (16 x 16-pixel patches, pooling 1, the 70-token budget, which keeps
this strip at its size); a prompt is <bos> <|image> 70 x <|image|> <image|> + the instruction (101
tokens); the answer (+ EOS) fits one canvas.

Choices that differ from the text recipe, each from a failed run (benchmarks/results/
bundled_vision_attempts.json): sliding_window=128, so every layer sees the whole picture (the released
model's 1024-token window holds its 280-token images too; with 32, only the one global layer could read
the picture from the canvas); init.vision_from_scratch (the reference's tower init gives every patch the
same position embedding); one digit per patch (digits spread over 8 x 8 patches of a 128 x 32 picture,
placed freely or in cells, were at 0% exact match after 1000 steps); half of the mix reading (with a
third, the picture was still unread after 950 steps).

Measured (benchmarks/results/bundled_vision_training.json): the 25-minute limit (train.time_limit_s)
stops the 3000-step schedule at step 2225 (1511 s, the two evaluations' 20 s included), learning rate
still 6e-4; held out, "sort" 439/500 (87.8%), "read" 494/500 (98.8%). Short of 90% on sort: a 2000-step
schedule, which would anneal inside the limit, began reading the picture only at step ~1200 (this one at
~600) and was stopped.
"""

import ml_collections

SORT = "sort the digits in the image"
READ = "read the digits in the image"


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        preset="",
        overrides=dict(
            vocab_size=43, hidden_size=64, num_layers=4, num_heads=4, head_dim=16, num_kv_heads=2,
            global_head_dim=32, num_global_kv_heads=1, intermediate_size=96, num_experts=4, top_k=2,
            moe_intermediate_size=48, sliding_window=128, canvas_length=8, max_position_embeddings=256,
            eos_ids=(1,), pad_id=0, bos_id=2, name="dgemma-tiny-vision-digits",
            # the image markers are the char tokenizer's last three ids (image_tasks.MARKERS)
            boi_token_id=40, image_token_id=41, eoi_token_id=42,
            vision=dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                        head_dim=16, patch_size=16, pooling_kernel_size=1, position_embedding_size=80,
                        default_soft_tokens=70)),
    ))
    c.init = ml_collections.ConfigDict(dict(kind="random", seed=0, embedding_std=0.125, vision_from_scratch=True))
    c.data = ml_collections.ConfigDict(dict(
        kind="image_tasks", tokenizer="image_tasks",
        image_tasks=[dict(op="sort", prompt=SORT, min_len=4, max_len=6, weight=1.0),
                     dict(op="read", prompt=READ, min_len=4, max_len=6, weight=1.0)],
        prompt_length=104, num_canvases=1, batch_size=32, seed=0,
    ))
    c.objective = ml_collections.ConfigDict(dict(t_eps=1e-3, sc_prob=0.5, ar_weight=1.0, ar_on_prompt=False,
                                                 weighting="none"))
    c.optimizer = ml_collections.ConfigDict(dict(
        peak_lr=3e-3, end_lr=1e-4, warmup_steps=200, b1=0.9, b2=0.99, eps=1e-8, weight_decay=1e-4,
        clip_norm=1.0, freeze_router=False))
    c.lora = ml_collections.ConfigDict(dict(enabled=False, rank=8, alpha=8.0, groups=("attention",)))
    c.train = ml_collections.ConfigDict(dict(
        workdir="/tmp/dgemma_vision", num_steps=3000, seed=0, log_every=25, checkpoint_every=500,
        eval_every=1000, max_to_keep=2, time_limit_s=1500, export=True, progress=True))
    c.eval = ml_collections.ConfigDict(dict(
        num_examples=200, batch_size=100, seed=12345,
        sampler=dict(max_denoising_steps=16, t_max=0.8, t_min=0.4, entropy_bound=0.1,
                     confidence_threshold=0.005, stability_threshold=1)))
    return c
