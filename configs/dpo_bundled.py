"""DPO on the bundled digit-sorting model (`benchmarks/dpo_bundled.py` runs it and measures it).

The preference: for a prompt "s<digits>=" the CHOSEN answer lists each distinct digit once, in order (a
shorter answer: "s3141592=" -> "123459"), the REJECTED one is the full sorted string the model was
trained to give ("11234599"). Pairs come from JSON lines written by the benchmark (data.path). Full
fine-tuning of the 299k-parameter model against a frozen copy of the bundled weights, likelihoods from
`likelihood.token_logprobs` (2 stratified noise draws per canvas, shared by the policy and the reference).
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(preset="", overrides={}))
    c.init = ml_collections.ConfigDict(dict(kind="bundled", name=""))
    c.data = ml_collections.ConfigDict(dict(
        kind="jsonl", tokenizer="tasks", path="", prompt_key="prompt", bos_id=2,
        prompt_length=19, num_canvases=3, batch_size=16, seed=0))
    c.objective = ml_collections.ConfigDict()
    c.optimizer = ml_collections.ConfigDict(dict(
        peak_lr=3e-4, end_lr=3e-5, warmup_steps=10, b1=0.9, b2=0.99, weight_decay=0.0, clip_norm=1.0,
        freeze_router=True))
    c.lora = ml_collections.ConfigDict(dict(enabled=False, rank=8, alpha=8.0, groups=("attention",)))
    c.rl = ml_collections.ConfigDict(dict(algorithm="dpo", dpo_beta=0.1, num_samples=2, t_eps=1e-3))
    c.train = ml_collections.ConfigDict(dict(
        workdir="/tmp/dgemma_dpo_bundled", num_steps=150, seed=0, log_every=10, checkpoint_every=50,
        eval_every=0, max_to_keep=1, export=True, progress=False, final_eval=False))
    c.eval = ml_collections.ConfigDict()
    return c
