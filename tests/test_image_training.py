"""Training the image path: the char tokenizer's image markers, the drawn-digit tasks and their batches
(laid out as inference lays out an image prompt), the objective through the vision tower, a recipe
run end to end, and the bundled image model (its accuracy and `dgemma generate --image` out of the box)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from dgemma_jax.config import ModelConfig, VisionConfig
from dgemma_jax.io import bundled
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.io.images import ImageTokenIds, preprocess_images, prompt_with_images, settings_for
from dgemma_jax.model.api import init_params
from dgemma_jax.training import image_tasks
from dgemma_jax.training.data import Layout
from dgemma_jax.training.objective import ObjectiveConfig, loss_fn
from tests.test_cli import _one_line_error, dgemma

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = CharTokenizer(image_tasks.VISION_CHARS, image_tasks.MARKERS)
SORT = "sort the digits in the image"


def _tiny_config(**vision) -> ModelConfig:
    v = dict(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
             patch_size=16, pooling_kernel_size=1, position_embedding_size=72, default_soft_tokens=70) | vision
    return ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, num_layers=2, num_heads=2, head_dim=16,
                       num_kv_heads=1, global_head_dim=16, num_global_kv_heads=1, intermediate_size=48,
                       num_experts=2, top_k=1, moe_intermediate_size=16, sliding_window=16, canvas_length=8,
                       max_position_embeddings=160, eos_ids=(1,), pad_id=0, bos_id=2, param_dtype="float32",
                       boi_token_id=40, image_token_id=41, eoi_token_id=42, vision=VisionConfig(**v))


# ------------------------------------------------------------------ tokenizer
def test_char_tokenizer_markers_are_one_token_each():
    ids = TOK.encode("<|image><|image|><|image|><image|>sort 3", add_bos=True)
    assert ids[:5] == [2, 40, 41, 41, 42] and len(ids) == 5 + len("sort 3")
    assert ImageTokenIds.from_tokenizer(TOK) == ImageTokenIds(image=41, boi=40, eoi=42)
    assert TOK.vocab_size == 3 + len(image_tasks.VISION_CHARS) + 3
    assert TOK.decode(ids) == "<|image><|image|><|image|><image|>sort 3"
    assert TOK.decode(ids, skip_special=True) == "sort 3"
    assert TOK.id_to_piece(41) == "<|image|>" and TOK.piece_to_id("<image|>") == 42
    # a marker that begins another is not cut by it
    tok = CharTokenizer("ab<>", ("<a>", "<a>>"))
    assert tok.encode("<a>><a>a") == [tok.piece_to_id("<a>>"), tok.piece_to_id("<a>"), tok.piece_to_id("a")]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TOK.encode("SORT")
    for bad in (("<x>", "<x>"), ("x",), ("<pad>",)):
        with pytest.raises(ValueError, match="markers"):
            CharTokenizer("ab", bad)


def test_char_tokenizer_files_keep_their_markers_and_old_files_still_load(tmp_path):
    TOK.save(tmp_path / "v.json")
    back = CharTokenizer.load(tmp_path / "v.json")
    assert back.markers == image_tasks.MARKERS and back.encode("<|image|>9") == TOK.encode("<|image|>9")
    (tmp_path / "old.json").write_text(json.dumps({"type": "char", "specials": ["<pad>", "<eos>", "<bos>"],
                                                   "chars": "0123"}))
    old = CharTokenizer.load(tmp_path / "old.json")
    assert old.markers == () and old.vocab_size == 7 and old.encode("30") == [6, 3]


# ------------------------------------------------------------------ pictures and tasks
def test_draw_digits_draws_the_digits_and_varies_the_style():
    a = image_tasks.draw_digits("1234", np.random.default_rng(0))
    assert a.shape == (16, 1120, 3) and a.dtype == np.uint8
    assert (a[:, 4 * 16:] > 150).all()                     # nothing drawn past the 4th 16-pixel cell
    assert np.array_equal(a, image_tasks.draw_digits("1234", np.random.default_rng(0)))     # deterministic
    assert not np.array_equal(a, image_tasks.draw_digits("1234", np.random.default_rng(1)))  # another style
    # the same style (rng) with other digits: ink where the glyphs differ; "8888" has more ink than "1111"
    def ink(d):
        px = image_tasks.draw_digits(d * 4, np.random.default_rng(3))[..., 0].astype(float)
        return np.clip(np.median(px) - 40 - px, 0, None).sum()   # darker than the paper, beyond its noise

    assert ink("8") > 1.3 * ink("1") > 0
    with pytest.raises(ValueError, match="do not fit"):
        image_tasks.draw_digits("1" * 71, np.random.default_rng(0))
    with pytest.raises(ValueError, match="digits"):
        image_tasks.draw_digits("12a", np.random.default_rng(0))


def test_task_answers_and_config_errors():
    rng = np.random.default_rng(5)
    sort = image_tasks.ImageDigitTask("sort", SORT, 3, 5)
    read = image_tasks.ImageDigitTask("read", "read the digits in the image", 3, 5)
    for _ in range(20):
        state = rng.bit_generator.state
        pic, prompt, ans = sort.sample(rng)
        assert pic.shape == (16, 1120, 3) and prompt == SORT and 3 <= len(ans) <= 5 and ans.isdigit()
        assert ans == "".join(sorted(ans))
        rng.bit_generator.state = state            # the same draws: the same digits, read as written
        pic2, _, written = read.sample(rng)
        assert np.array_equal(pic, pic2) and sorted(written) == sorted(ans)
    with pytest.raises(ValueError, match="op"):
        image_tasks.ImageDigitTask("add", SORT)
    with pytest.raises(ValueError, match="outside"):
        image_tasks.ImageDigitTask("sort", "Sort!")
    with pytest.raises(ValueError, match="min_len"):
        image_tasks.ImageDigitTask("sort", SORT, 5, 3)


def test_a_training_batch_lays_out_the_prompt_as_inference_does():
    cfg = _tiny_config()
    settings = settings_for(cfg)
    tasks = [image_tasks.ImageDigitTask("sort", SORT, 4, 6)]
    src = image_tasks.ImageTaskSource(tasks, TOK, Layout(104, 1, 8), 3, cfg, seed=4)
    batch = src.batch(2)
    problems = src.problems(2)
    assert batch["pixel_values"].shape == (3, 70, 3 * 16 * 16) and batch["pixel_positions"].shape == (3, 70, 2)
    # the strip is its own processed size: patch k of the picture is pixel columns 16k..16k+15
    picture = problems[0][0]
    np.testing.assert_allclose(batch["pixel_values"][0, 1].reshape(16, 16, 3), picture[:, 16:32] / 255.0, atol=1e-6)
    pre = preprocess_images([p for p, _, _ in problems], settings)
    np.testing.assert_array_equal(batch["pixel_values"], pre.pixel_values)
    np.testing.assert_array_equal(batch["pixel_positions"], pre.position_ids)
    for row, (picture, prompt, answer) in enumerate(problems):
        tokens, _, _ = prompt_with_images(cfg, TOK, prompt, picture)   # what `dgemma generate --image` builds
        n = tokens.shape[1]
        assert batch["prompt_lengths"][row] == n
        np.testing.assert_array_equal(batch["tokens"][row, :n], tokens[0])
        # spelled out: <bos> <|image> 70 x <|image|> (one per 16 x 16 patch) <image|> instruction
        assert tokens[0].tolist() == [2, 40] + [41] * 70 + [42] + TOK.encode(prompt)
        resp = batch["tokens"][row, n:n + len(answer) + 1]
        assert TOK.decode(resp) == answer and resp[-1] == 1
    with pytest.raises(ValueError, match="prompt_length"):
        image_tasks.ImageTaskSource(tasks, TOK, Layout(60, 1, 8), 2, cfg).batch(0)


# ------------------------------------------------------------------ the objective
def test_the_loss_reads_the_picture_and_trains_the_tower():
    cfg = _tiny_config()
    params = init_params(cfg, 1)
    src = image_tasks.ImageTaskSource([image_tasks.ImageDigitTask("read", "read the digits in the image", 4, 6)],
                                      TOK, Layout(104, 1, 8), 4, cfg, seed=0)
    batch = {k: jnp.asarray(v) for k, v in src.batch(0).items()}
    obj = ObjectiveConfig(canvas_length=8, sc_prob=0.5)
    key = jax.random.key(3)
    pins = dict(sc_override=jnp.array([True, False, True, False]), t_override=jnp.full((4,), 0.7))

    def loss(p, b):
        return loss_fn(p, b, key, config=cfg, obj=obj, **pins)

    (value, m), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, batch)
    assert np.isfinite(float(value)) and "ar_loss" in m
    for part in ("vision_tower", "embed_vision"):
        norm = float(sum(jnp.abs(g).sum() for g in jax.tree.leaves(grads[part])))
        assert norm > 0, part
    # other pictures with the same tokens: another loss (the picture reaches the prompt's placeholders)
    swapped = dict(batch, pixel_values=batch["pixel_values"][::-1], pixel_positions=batch["pixel_positions"][::-1])
    just_loss = jax.jit(lambda p, b: loss(p, b)[0])
    assert abs(float(just_loss(params, swapped)) - float(value)) > 1e-6
    # without pixels the placeholders embed as ordinary tokens: another loss again
    text_only = {k: v for k, v in batch.items() if not k.startswith("pixel_")}
    assert abs(float(just_loss(params, text_only)) - float(value)) > 1e-6


def test_the_rl_likelihood_reads_the_picture_and_image_prompts_carry_their_pictures():
    from dgemma_jax.training.likelihood import token_logprobs
    from dgemma_jax.training.rl import PromptSource

    cfg = _tiny_config()
    params = init_params(cfg, 1)
    tasks = [image_tasks.ImageDigitTask("sort", SORT, 4, 6)]
    src = image_tasks.ImageTaskSource(tasks, TOK, Layout(104, 1, 8), 4, cfg, seed=0)
    batch = {k: jnp.asarray(v) for k, v in src.batch(0).items()}
    score = jax.jit(lambda b: token_logprobs(params, b, jax.random.key(0), config=cfg, num_canvases=1)[0].sum())
    value = float(score(batch))
    swapped = dict(batch, pixel_values=batch["pixel_values"][::-1], pixel_positions=batch["pixel_positions"][::-1])
    assert np.isfinite(value) and abs(float(score(swapped)) - value) > 1e-6
    # RL prompts from picture tasks: the instructions, the answers as references, the pictures preprocessed
    prompts = PromptSource(4, 0, image_source=src).batch(0)
    problems = src.problems(0)
    assert prompts["prompts"] == [SORT] * 4 and prompts["references"] == [a for _, _, a in problems]
    np.testing.assert_array_equal(prompts["images"].pixel_values, np.asarray(batch["pixel_values"]))


# ------------------------------------------------------------------ a recipe run
def _recipe(tmp_path, **extra):
    from dgemma_jax.training.train import load_config

    over = {"train.workdir": str(tmp_path / "run"), "train.num_steps": 3, "train.log_every": 1,
            "train.eval_every": 0, "train.time_limit_s": 0, "train.progress": False, "train.checkpoint_every": 100,
            "data.batch_size": 4, "eval.num_examples": 6, "eval.batch_size": 6,
            "eval.sampler.max_denoising_steps": 2, "model.overrides.num_layers": 2,
            "model.overrides.vision.num_layers": 1, **extra}
    return load_config(os.path.join(ROOT, "configs", "train_vision_digits.py"), over)


def test_an_image_recipe_trains_the_tower_and_evaluates_on_pictures(tmp_path):
    from dgemma_jax.training.train import Run, train

    cfg = _recipe(tmp_path)
    init = jax.device_get(Run(cfg).state.params)
    summary = train(cfg)
    run = summary.pop("run")
    after = jax.device_get(run.state.params)
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(init["vision_tower"]), jax.tree.leaves(after["vision_tower"]))]
    assert max(moved) > 0                                   # the tower is trained, not frozen
    ev = summary["eval"]
    assert ev["n"] == 6 and 0.0 <= ev["accuracy"] <= 1.0 and ev["samples"][0]["prompt"] in (
        SORT, "read the digits in the image")
    # the eval pictures are held out: the eval seed may not be the data seed
    with pytest.raises(ValueError, match="eval.seed"):
        Run(_recipe(tmp_path, **{"eval.seed": 0}))
    with pytest.raises(ValueError, match="vision tower"):
        Run(_recipe(tmp_path, **{"model.overrides.vision": None}))


# ------------------------------------------------------------------ the checkpoint's soft-token budget
def test_the_checkpoint_sets_the_default_soft_token_budget(tmp_path):
    from dgemma_jax.io.model_dir import load_model, save_model

    cfg = _tiny_config()
    assert settings_for(cfg).max_soft_tokens == 70 and settings_for(cfg, 140).max_soft_tokens == 140
    assert VisionConfig().default_soft_tokens == 280
    with pytest.raises(ValueError, match="default_soft_tokens"):
        VisionConfig(default_soft_tokens=64)
    save_model(tmp_path / "m", cfg, init_params(cfg, 0))
    assert load_model(tmp_path / "m")[0].vision.default_soft_tokens == 70


# ------------------------------------------------------------------ the bundled image model
needs_bundled = pytest.mark.skipif(not os.path.isdir(bundled.asset_path(bundled.VISION_NAME)),
                                   reason="no bundled image model (run scripts/train_vision_bundled.py)")


@needs_bundled
def test_bundled_image_model_reaches_its_stated_accuracy():
    from dgemma_jax.training.evaluate import evaluate_exact_match

    config, params, sampler, tok = bundled.load_bundled(bundled.VISION_NAME)
    meta = bundled.load_metadata(bundled.VISION_NAME)
    # stated in docs/bundled_model.md: after 25 minutes of supervised training (the limit stops the run
    # after the step that crosses it: 1511 s; 87.8% sort) and 205 RL steps, 98.4% on 500 held-out sort
    # pictures and 99.6% read
    assert meta["eval"]["sort"]["accuracy"] >= 0.98 and meta["eval"]["sort"]["n"] >= 500
    assert meta["eval"]["read"]["accuracy"] >= 0.98 and meta["eval"]["read"]["n"] >= 500
    assert meta["rl"]["steps"] == 205 and meta["rl"]["before"]["sort"]["accuracy"] < 0.9
    assert meta["stopped_by_time_limit"] and meta["train_seconds"] <= 25 * 60 + 15
    ci = meta["ci_sample"]
    sort = next(t for t in image_tasks.tasks_from_config(meta["image_tasks"]) if t.op == "sort")
    problems = image_tasks.heldout_examples([sort], ci["n"], ci["seed"])
    lay = meta["layout"]
    r = evaluate_exact_match(config, params, sampler, tok, [(p, a) for _, p, a in problems],
                             prompt_width=lay["prompt_length"], max_new_tokens=lay["num_canvases"] * lay["canvas_length"],
                             batch_size=ci["n"], seed=ci["seed"], images=[im for im, _, _ in problems])
    # the same pictures and rng as when the metadata was written; 2 examples of slack for float differences
    assert r["accuracy"] >= ci["accuracy"] - 0.02, (r["accuracy"], ci["accuracy"], r["failures"])
    assert r["accuracy"] >= 0.95


@needs_bundled
def test_generate_with_an_image_works_out_of_the_box():
    meta = bundled.load_metadata(bundled.VISION_NAME)
    ex = meta["example"]
    path = os.path.join(ROOT, ex["path"])
    # the committed picture is the held-out one the metadata names (no training batch drew it); equal here,
    # close where another Pillow / FreeType rasterises the glyphs a little differently
    drawn = image_tasks.draw_digits(ex["digits"], np.random.default_rng(ex["seed"])).astype(float)
    diff = np.abs(np.asarray(Image.open(path).convert("RGB"), float) - drawn)
    assert diff.mean() < 2.0 and (diff > 64).mean() < 0.01, (diff.mean(), (diff > 64).mean())
    r = dgemma("generate", "--image", ex["path"], "--prompt", SORT, "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == ex["answer"] == "".join(sorted(ex["digits"]))
    assert bundled.VISION_NAME in r.stderr
    # named explicitly, and a name that is not bundled
    r = dgemma("generate", "--checkpoint", f"bundled:{bundled.VISION_NAME}", "--image", ex["path"], "--prompt",
               "read the digits in the image", "--quiet")
    assert r.returncode == 0 and r.stdout.strip() == ex["digits"], (r.stdout, r.stderr[-2000:])


def test_an_unknown_bundled_name_is_one_clear_error():
    line = _one_line_error(dgemma("generate", "--checkpoint", "bundled:nope", "--prompt", "1"))
    assert "nope" in line and bundled.DEFAULT_NAME in line
    line = _one_line_error(dgemma("inspect", "--checkpoint", "bundled:nope"))
    assert "nope" in line and bundled.DEFAULT_NAME in line
