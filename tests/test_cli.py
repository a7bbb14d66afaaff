"""End-to-end tests of the `dgemma` command (subprocesses, as a user runs it)."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params, save_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dgemma(*args, stdin=None, timeout=600, env=None):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu") if env is None else env
    return subprocess.run([sys.executable, "-m", "dgemma_jax.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def _one_line_error(r, code=2):
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dgemma: error:"), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A small Hugging Face-format DiffusionGemma directory with a word-level tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = ModelConfig.preset("tiny-6layer")
    path = tmp_path_factory.mktemp("hf")
    save_hf(init_params(cfg, 3), cfg, path, generation_config={
        "max_denoising_steps": 4, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
        "confidence_threshold": 0.005, "sampler_config": {"entropy_bound": 0.1}, "eos_token_id": [1],
        "pad_token_id": 0})
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({f"w{i}": i for i in range(3, cfg.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_inspect_26b():
    r = dgemma("inspect", "--preset", "diffusiongemma-26b-a4b", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["layers"] == 30 and info["layer_types"] == "sssssG" * 5
    assert abs(info["params_total"] / 25.25e9 - 1) < 0.01 and abs(info["params_active_per_token"] / 3.84e9 - 1) < 0.01
    r = dgemma("inspect", "--preset", "diffusiongemma-26b-a4b")
    assert "params_total" in r.stdout and "GB" in r.stdout


def test_inspect_checkpoint(hf_checkpoint):
    r = dgemma("inspect", "--checkpoint", str(hf_checkpoint), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"] == 6


def test_convert_then_generate(hf_checkpoint, tmp_path):
    out = tmp_path / "ours"
    r = dgemma("convert", str(hf_checkpoint), str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "dgemma_model.json").is_file() and (out / "tokenizer.json").is_file()
    meta = json.loads((out / "dgemma_model.json").read_text())
    assert meta["sampler"]["max_denoising_steps"] == 4
    # the bar and the closing line count the same tensors (the bar showed 97/97, the line "92 tensors")
    done, total = map(int, re.findall(r"(\d+)/(\d+) \[", r.stderr)[-1])
    said = int(re.search(r"converted (\d+) tensors", r.stdout).group(1))
    assert done == total == said == len(jax.tree.leaves(init_params(ModelConfig.preset("tiny-6layer"), 0))), r.stderr
    r = dgemma("generate", "--checkpoint", str(out), "--prompt", "w5 w7 w9 w11", "--max-new-tokens", "24",
               "--seed", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    words = r.stdout.split()
    assert words and all(w.startswith("w") for w in words)
    assert "tokens per forward pass" in r.stderr and "steps per canvas [4, 4]" in r.stderr
    assert f"dgemma: loaded {out} in" in r.stderr and "program(s) compiled in" in r.stderr, r.stderr
    # same seed -> same text; the HF directory itself works too
    r2 = dgemma("generate", "--checkpoint", str(hf_checkpoint), "--prompt", "w5 w7 w9 w11", "--max-new-tokens",
                "24", "--seed", "1", "--quiet")
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert r2.stdout == r.stdout


def test_generate_and_chat_show_load_and_compile_progress_on_a_pipe():
    # loading and compiling printed nothing: for the 26B that is minutes of silence. A pipe gets a few
    # lines on stderr (a terminal gets bars); --quiet none
    r = dgemma("generate", "--prompt", "s9350814272=")
    assert r.returncode == 0 and r.stdout.strip() == "0122345789", r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dgemma: ")]
    # what is loading / compiling is announced once it has taken 1.5 s (so that a bad input's error stays alone)
    lines = [ln for ln in lines if ln not in ("dgemma: loading the bundled model dgemma-tiny-digits ...",
                                              "dgemma: compiling the programs (or reading them from the "
                                              "compilation cache) ...")]
    assert lines[0].startswith("dgemma: loaded the bundled model dgemma-tiny-digits in ")
    assert re.match(r"dgemma: \d+ program\(s\) compiled in [\d.]+ s, \d+ read from the compilation cache$",
                    lines[-1]), lines
    assert len(lines) <= 8 and "\r" not in r.stderr, r.stderr  # a few lines, no bar redraws
    r = dgemma("chat", stdin="s9350814272=\ns93=\n")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dgemma: ")]
    assert sum(ln.startswith("dgemma: loaded the bundled model") for ln in lines) == 1, lines
    assert sum(re.search(r"\d+ program\(s\) compiled in", ln) is not None for ln in lines) >= 1, lines
    assert sum(ln.startswith("dgemma: compiling the programs") for ln in lines) <= 1, lines  # not per turn


def test_generate_show_steps_non_tty(hf_checkpoint):
    r = dgemma("generate", "--checkpoint", str(hf_checkpoint), "--prompt", "w5 w6", "--max-new-tokens", "16",
               "--show-steps")
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("[canvas 0 step")]
    assert len(steps) == 4 and "settled" in steps[0]
    assert "\x1b[" not in r.stdout  # no terminal codes when stdout is not a terminal


def test_seed_canvas_pins_tokens(hf_checkpoint):
    r = dgemma("generate", "--checkpoint", str(hf_checkpoint), "--prompt", "w5", "--max-new-tokens", "16",
               "--seed-canvas", "w40 w41 _ _ w42", "--mask-char", "_", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    words = r.stdout.split()
    assert words[:2] == ["w40", "w41"] and words[4] == "w42"


def test_error_paths(hf_checkpoint, tmp_path):
    msg = _one_line_error(dgemma("generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"))
    assert "does not exist" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = _one_line_error(dgemma("generate", "--checkpoint", str(empty), "--prompt", "x"))
    assert "not a checkpoint" in msg
    msg = _one_line_error(dgemma("generate", "--checkpoint", str(hf_checkpoint), "--prompt", "w5 w6 w7",
                                 "--max-prompt", "2"))
    assert "longer than --max-prompt" in msg
    msg = _one_line_error(dgemma("generate", "--checkpoint", str(hf_checkpoint), "--prompt", "w5",
                                 "--max-new-tokens", "300000"))
    assert "max_position_embeddings" in msg
    assert "must be > 0" in _one_line_error(dgemma("generate", "--steps", "0"))
    assert "invalid choice" in _one_line_error(dgemma("frobnicate"))
    msg = _one_line_error(dgemma("convert", str(empty), str(tmp_path / "out")))
    assert "cannot tell the format" in msg
    msg = _one_line_error(dgemma("generate", "--checkpoint", str(hf_checkpoint), "--prompt", "w5",
                                 "--seed-canvas", " ".join(["w3"] * 40)))
    assert "canvas holds 16" in msg


def test_convert_gemma_layout(tmp_path):
    """Round trip through our own export of the gemma layout (`params_to_gemma`): identical parameters.
    The release's layout itself, written from Google's code, is tested in test_convert_gemma.py."""
    import jax
    import orbax.checkpoint as ocp

    from dgemma_jax.io.convert import params_to_gemma
    from dgemma_jax.io.model_dir import load_model

    cfg = ModelConfig.preset("tiny-6layer")
    params = init_params(cfg, 5)
    src = tmp_path / "gemma_ckpt"
    with ocp.StandardCheckpointer() as c:
        c.save(str(src), params_to_gemma(params, cfg))
    r = dgemma("convert", str(src), str(tmp_path / "ours"), "--from", "gemma", "--quiet", "--preset", "tiny-6layer")
    assert r.returncode == 0, r.stderr[-2000:]
    cfg2, params2, _ = load_model(tmp_path / "ours")
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_chat_two_turns_from_stdin_reuses_the_cache(hf_checkpoint):
    r = dgemma("chat", "--checkpoint", str(hf_checkpoint), "--thinking", "--max-new-tokens", "32",
               "--context", "512", stdin="w5 w6 w7\nw8 w9\n")
    assert r.returncode == 0, r.stderr[-2000:]
    replies = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(replies) == 2
    stats = [ln for ln in r.stderr.splitlines() if ln.startswith("[turn")]
    assert len(stats) == 2 and "reused 0 cached" in stats[0]
    reused = int(stats[1].split("reused ")[1].split()[0])
    assert reused > 16, stats  # the first turn's prompt + its committed canvas stay in the cache


def test_pipeline_object(hf_checkpoint):
    from dgemma_jax.pipeline import DiffusionGemma

    dg = DiffusionGemma.from_pretrained(str(hf_checkpoint))
    assert dg.sampler.max_denoising_steps == 4  # read from generation_config.json
    one = dg.generate("w5 w6 w7", max_new_tokens=16, seed=3)
    assert isinstance(one, str) and one == dg.generate("w5 w6 w7", max_new_tokens=16, seed=3)
    two = dg.generate(["w5 w6 w7", "w9"], max_new_tokens=16, seed=3)
    assert isinstance(two, list) and len(two) == 2 and all(isinstance(t, str) for t in two)
    assert isinstance(dg.chat([{"role": "user", "content": "w5 w6"}], max_new_tokens=16), str)
    with pytest.raises(ValueError, match="no prompts"):
        dg.generate([], max_new_tokens=16)
    assert isinstance(dg.generate("w5", max_new_tokens=16, seed=2**40), str)  # any 64-bit seed


# ------------------------------------------------------------------ the bundled model (default checkpoint)
def test_generate_with_the_bundled_model():
    # the README's first command, as written: the default --max-new-tokens (256) is capped to the
    # whole canvases that fit the bundled model's 256 positions after the prompt
    r = dgemma("generate", "--prompt", "s9350814272=")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0122345789"
    assert "canvas(es)" in r.stderr and "tokens per forward pass" in r.stderr


def test_bundled_show_steps_and_errors():
    r = dgemma("generate", "--prompt", "s31415926535=", "--max-new-tokens", "24", "--show-steps")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "".join(sorted("31415926535"))
    assert any(ln.startswith("[canvas 1 step") for ln in lines)
    msg = _one_line_error(dgemma("generate", "--prompt", "s" + "1" * 300 + "="))
    assert "max_position_embeddings" in msg
    msg = _one_line_error(dgemma("generate", "--prompt", "hello"))
    assert "not in the vocabulary" in msg


def test_generate_suffix_fills_the_middle_with_the_bundled_model():
    # sorted "31415926535" is 11233455569: the prompt ends at the canvas boundary, the suffix "9" follows
    r = dgemma("generate", "--prompt", "s31415926535=", "--suffix", "9", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "1123345556"
    assert "middle lengths tried" in r.stderr
    msg = _one_line_error(dgemma("generate", "--prompt", "s3=", "--suffix", "9", "--seed-canvas", "1__"))
    assert "--suffix cannot be combined with --seed-canvas" in msg
    msg = _one_line_error(dgemma("generate", "--prompt", "s3=", "--suffix", ""))
    assert "--suffix is empty" in msg


# ------------------------------------------------------------------ one-line errors (issue 20, item 6)
def test_every_64_bit_seed_works_and_2_to_the_64_is_a_one_line_error():
    # 2**63 .. 2**64-1 ended in an OverflowError traceback (jax.random.key takes a signed 64-bit int)
    for seed in (2**63, 2**64 - 1, -(2**63)):
        r = dgemma("generate", "--prompt", "s9350814272=", "--seed", str(seed), "--quiet")
        assert r.returncode == 0, (seed, r.stderr[-2000:])
        assert r.stdout.strip() == "0122345789"
    msg = _one_line_error(dgemma("generate", "--prompt", "s1=", "--seed", str(2**64)))
    assert "--seed" in msg and "does not fit in 64 bits" in msg


def test_piped_prompt_loses_its_final_newline():
    # `echo PROMPT | dgemma generate`: the newline echo adds is not part of the prompt (it was fed to
    # the tokenizer: "character '\n' is not in the vocabulary")
    r = dgemma("generate", "--quiet", stdin="s9350814272=\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0122345789"


def test_no_libtpu_probing_noise_on_a_machine_without_a_tpu():
    # with the [tpu] extra installed, JAX's TPU probe made libtpu print about five error lines
    # before every command's output on a CPU-only machine; the command's stderr is now its own
    from dgemma_jax.backends import tpu_chips

    if tpu_chips() != 0:
        pytest.skip("this machine has a TPU (or JAX cannot count its chips)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = ROOT
    r = dgemma("generate", "--prompt", "s9350814272=", "--quiet", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0122345789" and r.stderr.strip() == "", r.stderr


LIBRARY_GENERATE = ("import dgemma_jax as dg, jax\n"
                    "print(dg.DiffusionGemma.from_pretrained().generate('s9350814272='))\n"
                    "print(jax.default_backend())\n")


def test_the_library_is_as_quiet_as_the_cli_without_a_tpu():
    # `import dgemma_jax` then a generate printed libtpu's probing lines (host bounds,
    # TPU_WORKER_HOSTNAMES) on a CPU-only machine with the [tpu] extra; only the CLI hid them
    from dgemma_jax.backends import tpu_chips

    if tpu_chips() != 0:
        pytest.skip("this machine has a TPU (or JAX cannot count its chips)")
    pytest.importorskip("libtpu")  # without libtpu there is no noise to hide
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, "-c", LIBRARY_GENERATE], capture_output=True, text=True, timeout=600,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0122345789", "cpu"], r.stdout
    assert "libtpu" not in r.stderr and "TPU_" not in r.stderr and r.stderr.strip() == "", r.stderr


def test_config_that_disagrees_with_its_parameters_names_the_tensor(tmp_path):
    # an edited dgemma_model.json ended in a flax ScopeParamShapeError traceback (exit 1)
    import shutil

    from dgemma_jax.training.bundled import asset_path

    path = tmp_path / "edited"
    shutil.copytree(asset_path(), path)
    meta = json.loads((path / "dgemma_model.json").read_text())
    meta["config"]["intermediate_size"] = 128  # the parameters were trained with 96
    (path / "dgemma_model.json").write_text(json.dumps(meta))
    msg = _one_line_error(dgemma("generate", "--checkpoint", str(path), "--prompt", "s12="))
    assert "blocks_0/dense_mlp/" in msg and "expects shape (128, 64)" in msg and "holds (96, 64)" in msg, msg


# ------------------------------------------------------------------ no silent wrong defaults (issue 20, item 5)
def test_unknown_config_key_is_an_error_naming_the_nearest_valid_key(tmp_path):
    # `--set train.num_stepz=5` (a typo) was accepted and the recipe's default 40-step run started
    from dgemma_jax.training.train import load_config

    recipe = os.path.join(ROOT, "configs", "train_tiny.py")
    msg = _one_line_error(dgemma("train", "--config", recipe, "--set", "train.num_stepz=5",
                                 "--set", f"train.workdir={tmp_path / 'run'}"))
    assert "unknown config key 'train.num_stepz'" in msg and "did you mean 'train.num_steps'?" in msg, msg
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="did you mean 'model.overrides.remat'"):
        load_config(recipe, {"model.overides.remat": True})
    # keys the trainer reads that this recipe does not list stay valid
    cfg = load_config(recipe, {"train.mesh": "expert=2", "model.overrides.remat": True, "eval.sampler.t_max": 0.7,
                               "optimizer.b1": 0.9, "train.time_limit_s": 5})
    assert cfg.train.mesh == "expert=2" and cfg.model.overrides.remat and cfg.eval.sampler.t_max == 0.7


def test_pipeline_default_length_is_the_command_lines():
    # DiffusionGemma.from_pretrained().generate(text) stopped after one canvas (8 tokens on the
    # bundled model: '01223457') while `dgemma generate` gives up to 256
    import warnings

    from dgemma_jax.errors import DgemmaWarning
    from dgemma_jax.pipeline import DiffusionGemma

    dg = DiffusionGemma.from_pretrained()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DgemmaWarning)  # a finished answer is not "cut short"
        assert dg.generate("s9350814272=") == "0122345789"
    # an output that the model's 256 positions cut short says so
    with pytest.warns(DgemmaWarning, match=r"cut short at 8 new tokens .* a 243-token prompt .* 256 positions"):
        assert dg.generate("s" + "1" * 240 + "=") == "1" * 8


def test_cut_short_output_and_untrained_canvas_length_are_warned():
    # a 242-character prompt's output was capped to 8 tokens without a word; --canvas-length 3 on
    # the bundled model (trained with 8) gave wrong answers without a word
    r = dgemma("generate", "--prompt", "s" + "1" * 240 + "=", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "1" * 8
    warning = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(warning) == 1 and warning[0].startswith("dgemma: warning: the output was cut short at 8 new tokens")
    r = dgemma("generate", "--prompt", "s9350814272=", "--canvas-length", "3", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip() == ("dgemma: warning: canvas length 3 is not the 8 this model was trained with (its "
                                "config's canvas_length); answers may be wrong: use a canvas length of 8")


def test_convert_refuses_to_overwrite_and_warns_without_a_tokenizer(hf_checkpoint, tmp_path):
    # convert replaced an existing destination without asking, converted a directory without a
    # tokenizer in silence, and generate then asked for a `--tokenizer` flag that does not exist
    import shutil

    src = tmp_path / "no_tok"
    shutil.copytree(hf_checkpoint, src)
    (src / "tokenizer.json").unlink()
    out = tmp_path / "ours"
    r = dgemma("convert", str(src), str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.startswith("dgemma: warning: no tokenizer came along") and str(out) in r.stderr, r.stderr
    msg = _one_line_error(dgemma("convert", str(src), str(out), "--quiet"))
    assert "already exists" in msg and "--force" in msg
    r = dgemma("convert", str(src), str(out), "--quiet", "--force")
    assert r.returncode == 0, r.stderr[-2000:]
    msg = _one_line_error(dgemma("generate", "--checkpoint", str(out), "--prompt", "w5"))
    assert "has no tokenizer: copy the model's tokenizer.json or tokenizer.model into" in msg
    assert "--tokenizer" not in msg
    shutil.copyfile(hf_checkpoint / "tokenizer.json", out / "tokenizer.json")  # as the messages say
    r = dgemma("generate", "--checkpoint", str(out), "--prompt", "w5 w6", "--max-new-tokens", "16", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() and all(w.startswith("w") for w in r.stdout.split())


# ------------------------------------------------------------------ progress and defaults (issue 20, item 7)
def test_inspect_defaults_to_the_bundled_model_like_the_other_commands():
    # `dgemma inspect` described the 26B preset while generate/chat default to the bundled model
    r = dgemma("inspect", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["name"] == "dgemma-tiny-digits" and info["layers"] == 4 and info["canvas"] == 8
    msg = _one_line_error(dgemma("inspect", "--preset", "bench", "--checkpoint", "bundled"))
    assert "--checkpoint or --preset, not both" in msg


def test_bench_help_lists_the_benchmarks_options():
    # `dgemma bench --help` showed only a `rest` argument, not the benchmark's options
    r = dgemma("bench", "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in ("--quick", "--out", "--skip-hf", "--cores", "--render"):
        assert flag in r.stdout, r.stdout


def test_bench_writes_to_a_scratch_path_unless_told(monkeypatch):
    # `dgemma bench` wrote over the committed benchmarks/results/bench_cpu.json by default
    import runpy
    import tempfile

    from dgemma_jax import cli

    seen = []
    monkeypatch.setattr(runpy, "run_path", lambda path, run_name=None: seen.append((path, list(sys.argv))))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli.main(["bench", "--quick"]) == 0
    script, argv = seen[-1]
    assert script.endswith(os.path.join("benchmarks", "bench_cpu.py"))
    out = argv[argv.index("--out") + 1]
    assert argv[1] == "--quick" and out.startswith(tempfile.gettempdir())
    assert not os.path.abspath(out).startswith(os.path.join(ROOT, "benchmarks"))
    assert cli.main(["bench", "--", "--quick", "--out", "x.json"]) == 0  # told: as given
    assert seen[-1][1][1:] == ["--quick", "--out", "x.json"]
    assert cli.main(["bench", "--render", "r.json"]) == 0  # re-rendering writes next to its input
    assert seen[-1][1][1:] == ["--render", "r.json"]


# ------------------------------------------------------------------ chat reuses its cache (issue 20, item 4)
MARKERS = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """A small Hugging Face-format model whose word-level tokenizer knows the Gemma 4 chat markers
    (<|turn> ... <channel|> are single special tokens, `<turn|>` also ends a reply), so that the
    rendered chat template encodes as it does with a Gemma tokenizer (without the newlines)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    cfg = ModelConfig.preset("tiny-6layer", eos_ids=(1, 5))
    path = tmp_path_factory.mktemp("chat")
    save_hf(init_params(cfg, 11), cfg, path, generation_config={
        "max_denoising_steps": 4, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
        "confidence_threshold": 0.005, "sampler_config": {"entropy_bound": 0.1}, "eos_token_id": [1, 5],
        "pad_token_id": 0})
    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + MARKERS + ["user", "model", "system", "thought"]
    words += [f"w{i}" for i in range(len(words), cfg.vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in words[:4] + MARKERS])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_reuses_the_cache_on_turns_2_and_3_with_the_answers_of_a_fresh_prefill(chat_checkpoint, thinking):
    # without thinking, turn 2 reused 0 cached tokens: the generation prompt's empty thought
    # channel is not in the rendered history, and only a cache holding an exact prefix was reused;
    # with thinking, a turn that had thought dropped its cache
    from dgemma_jax.chat_session import ChatSession
    from dgemma_jax.engine import Engine
    from dgemma_jax.model.cache import rewind_ok
    from dgemma_jax.pipeline import load_checkpoint

    cfg, params, sampler, tok = load_checkpoint(str(chat_checkpoint))
    engine = Engine(cfg, params, sampler)
    session = ChatSession(engine, tok, system="w20 w21", thinking=thinking, context=256, max_new_tokens=32, seed=7)
    turns, rows = [], []
    for text in ("w30 w31 w32", "w40 w41", "w50 w51 w52 w53"):
        rows.append(int(np.asarray(session.cache.lengths)[0]) if session.cache is not None else 0)
        turns.append(session.send(text))
    assert turns[0].reused == 0 and turns[0].prefilled == len(turns[0].prompt_ids)
    model_header = tok.encode("<|turn>model")
    for prev, turn, row in zip(turns, turns[1:], rows[1:]):
        assert turn.reused + turn.prefilled == len(turn.prompt_ids)
        if thinking:  # the generation prompt ends at `<|turn>model`: all of it is reused
            assert turn.reused >= len(prev.prompt_ids), (turn.reused, len(prev.prompt_ids))
        else:  # all but the empty thought channel `<|channel> thought <channel|>` it ends with, when the
            # sliding layers' ring caches still hold the window before it (model/cache.py), else nothing
            assert prev.prompt_ids[-5:-3] == model_header
            keep = len(prev.prompt_ids) - 3
            assert turn.reused == (keep if rewind_ok(cfg, turn.cache_length, row, keep) else 0)
        # the same tokens as generating from a fresh prefill of the whole conversation
        fresh = engine.generate(np.array([turn.prompt_ids], np.int32), None, rng=turn.rng,
                                max_new_tokens=turn.max_new_tokens, cache_length=turn.cache_length)
        np.testing.assert_array_equal(np.asarray(fresh.tokens)[0], turn.tokens)


def test_chat_command_reuses_the_cache_without_thinking(chat_checkpoint):
    r = dgemma("chat", "--checkpoint", str(chat_checkpoint), "--max-new-tokens", "32", "--context", "256",
               stdin="w30 w31 w32\nw40 w41\nw50 w51\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len([ln for ln in r.stdout.splitlines() if ln.strip()]) == 3
    stats = [ln for ln in r.stderr.splitlines() if ln.startswith("[turn")]
    reused = [int(s.split("reused ")[1].split()[0]) for s in stats]
    assert len(reused) == 3 and reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1], stats


def test_chat_replies_lose_their_thinking_with_a_gemma_like_tokenizer(chat_checkpoint, monkeypatch):
    # replies were decoded with skip_special, which drops the <|channel> / <channel|> markers, so
    # strip_thinking found no channel and the thought stayed in DiffusionGemma.chat's answer
    from types import SimpleNamespace

    from dgemma_jax.chat_session import split_reply
    from dgemma_jax.pipeline import DiffusionGemma

    dg = DiffusionGemma.from_pretrained(str(chat_checkpoint))
    reply = dg.tokenizer.encode("<|channel> thought w20 w21 <channel|> w30 w31 <turn|>")
    thought, answer = split_reply(dg.tokenizer, reply)
    assert answer == "w30 w31" and "w20 w21" in thought and "w3" not in thought
    tokens = np.array([reply + [0] * (32 - len(reply))], np.int32)
    monkeypatch.setattr(dg.engine, "generate", lambda *a, **k: SimpleNamespace(
        tokens=tokens, finished=np.array([True]), steps=np.array([[1]])))
    assert dg.chat([{"role": "user", "content": "w5"}], max_new_tokens=32, enable_thinking=True) == "w30 w31"


# ------------------------------------------------------------------ chat --show-steps (issue 32, item 4)
def _turns(stderr):
    """[(step lines, the turn's stats line)] of a `dgemma chat --show-steps` stderr, turn by turn."""
    turns, steps = [], []
    for ln in stderr.splitlines():
        if ln.startswith("[canvas "):
            steps.append(ln)
        elif ln.startswith("[turn "):
            turns.append((steps, ln.split(";")[0]))
            steps = []
    return turns


def test_chat_show_steps_draws_each_turn_on_stderr_with_the_same_answers_and_cache_reuse():
    # the bundled model, two turns sharing a prefix: the second reuses the first's cache
    chat = ("chat", "--seed", "3", "--max-new-tokens", "16")
    stdin = "s31415926535=\ns31415926000=\n"
    shown, fused = dgemma(*chat, "--show-steps", "--plain", stdin=stdin), dgemma(*chat, stdin=stdin)
    assert shown.returncode == 0 and fused.returncode == 0, (shown.stderr[-2000:], fused.stderr[-2000:])
    assert shown.stdout == fused.stdout  # the answers only: the steps go to stderr
    assert shown.stdout.splitlines() == ["11233455569", "00011234569"]
    turns = _turns(shown.stderr)
    assert [stats for _, stats in turns] == [s.split(";")[0] for s in fused.stderr.splitlines() if s.startswith("[turn")]
    assert "reused 0 cached" in turns[0][1] and "reused 10 cached" in turns[1][1], turns
    for lines, stats in turns:  # one line per denoising step of each canvas
        per_canvas = [int(n) for n in stats.split("steps [")[1].rstrip("]").split(",")]
        assert [sum(ln.startswith(f"[canvas {c} step") for ln in lines) for c in range(len(per_canvas))] == per_canvas
        assert all("settled" in ln for ln in lines)
    assert "\x1b[" not in shown.stderr


def test_chat_session_steps_give_the_fused_turns_and_cache_without_batch_invariance():
    # ChatSession.send(on_step=...) runs Engine.steps(cache=..., final_cache=True); the per-row
    # path is the CLI test's, this is the batched one (Engine(batch_invariant=False))
    import jax

    from dgemma_jax.chat_session import ChatSession
    from dgemma_jax.engine import Engine
    from dgemma_jax.engine.drivers import CanvasEvent, StepEvent
    from dgemma_jax.pipeline import load_checkpoint

    cfg, params, sampler, tok = load_checkpoint(None)
    engine = Engine(cfg, params, sampler, batch_invariant=False)
    sessions = [ChatSession(engine, tok, context=256, max_new_tokens=16, seed=3) for _ in range(2)]
    for text in ("s31415926535=", "s31415926000="):
        events = []
        shown, fused = sessions[0].send(text, on_step=events.append), sessions[1].send(text)
        np.testing.assert_array_equal(shown.tokens, fused.tokens)
        assert (shown.answer, shown.reused, shown.prefilled, shown.steps) == (
            fused.answer, fused.reused, fused.prefilled, fused.steps)
        assert sum(isinstance(e, StepEvent) for e in events) == sum(fused.steps)
        assert [e.index for e in events if isinstance(e, CanvasEvent)] == list(range(len(fused.steps)))
        assert sessions[0].cached_ids == sessions[1].cached_ids
        for a, b in zip(*(jax.tree.leaves(s.cache) for s in sessions)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert shown.reused == 10 and shown.answer == "00011234569"


# ------------------------------------------------------------------ issue 46: a new user's CLI mistakes
def _subcommands():
    import argparse

    from dgemma_jax.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, action.choices


def test_top_level_help_names_every_command_and_every_generate_flag_has_help():
    # the description left out `serve`; --t-max, --t-min, --entropy-bound, --canvas-length, --dtype,
    # --mask-char and --max-prompt had no help; --steps said "default 48" where the bundled model uses 16
    parser, commands = _subcommands()
    description = parser.description
    for name in commands:
        assert name in description, (name, description)
    generate = commands["generate"]
    bare = [a.option_strings[0] for a in generate._actions if a.option_strings and not a.help]
    assert not bare, f"generate flags without help: {bare}"
    steps = next(a for a in generate._actions if "--steps" in a.option_strings)
    assert "16" in steps.help and "bundled" in steps.help, steps.help


def test_convert_into_a_missing_parent_directory_is_refused(tmp_path, capsys):
    # `dgemma convert SRC /typo/dir/out` created the whole missing path silently
    from dgemma_jax.cli import main
    from dgemma_jax.training.bundled import asset_path

    dst = tmp_path / "no" / "such" / "out"
    assert main(["convert", str(asset_path()), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dgemma: error:") and "does not exist" in err[0], err
    assert not (tmp_path / "no").exists()


def test_profile_into_an_unwritable_place_is_one_line(tmp_path):
    # --profile to a path under a file ended in a 20-line traceback from the profiler
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    msg = _one_line_error(dgemma("generate", "--prompt", "s9350814272=", "--quiet",
                                 "--profile", str(blocker / "trace")))
    assert "--profile" in msg and "writable" in msg, msg


def test_a_rules_typo_is_an_error_without_mesh(capsys):
    # `--rules servng` passed silently when no --mesh was given (the rules were never read)
    from dgemma_jax.cli import main

    assert main(["generate", "--prompt", "s12=", "--rules", "servng"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dgemma: error:") and "servng" in err[0] and "serving" in err[0], err


def test_train_refuses_a_config_that_is_not_a_recipe_without_running_it(tmp_path, capsys):
    # a non-recipe said "'NoneType' object has no attribute 'loader'"; setup.py was executed
    from dgemma_jax.cli import main

    ran = tmp_path / "ran"
    script = tmp_path / "setup.py"
    script.write_text(f"open({str(ran)!r}, 'w').write('x')\n")
    data = tmp_path / "data.json"
    data.write_text("{}")
    for path, words in ((script, "defines no get_config"), (data, "not a Python recipe")):
        assert main(["train", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dgemma: error:") and words in err[0], err
    assert not ran.exists(), "the non-recipe file was executed"


def test_inspect_gives_the_quantized_sizes_the_docs_give(capsys):
    # `dgemma inspect` gave int8 as 25.25 GB (one byte per parameter) where the README says 26.07
    # (scales and the float embedding included), and had no int4 line
    from dgemma_jax.cli import main

    assert main(["inspect", "--preset", "diffusiongemma-26b-a4b", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory_bytes"]
    assert round(memory["int8"] / 1e9, 2) == 26.07 and round(memory["int4"] / 1e9, 2) == 13.52, memory
    assert round(memory["bfloat16"] / 1e9, 1) == 50.5, memory
