"""Progress bars of a start (`dgemma_jax.progress`): the compile bar counts the programs jax compiles
in its block and names them; the tensor bar of a quantizing load steps once per parameter read."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params, save_hf
from dgemma_jax.progress import compiling


def test_the_compile_bar_counts_and_names_the_programs_compiled_in_its_block(capsys):
    def first_program(x):
        return jnp.sin(x) * 3

    def second_program(x):
        return jnp.cos(x) + jnp.arange(x.shape[0])

    x = jnp.ones((7,), jnp.float32)
    with compiling("compiling", refresh_seconds=0.05) as bar:
        jax.jit(first_program)(x).block_until_ready()
        jax.jit(second_program)(x).block_until_ready()
        jax.jit(first_program)(x).block_until_ready()  # already compiled: not counted again
        counted = bar.n
    assert counted >= 2, counted  # jax may compile a helper program too (e.g. arange's)
    err = capsys.readouterr().err
    assert re.search(r"compiling: \d+ programs", err), err
    assert "second_program" in err, err
    # the listener is gone once the block ends: a compile afterwards is not counted
    jax.jit(lambda y: y - 1)(x).block_until_ready()
    assert bar.n == counted


def test_from_pretrained_shows_one_bar_step_per_tensor_read_and_quantized(tmp_path, capsys):
    # one step per parameter tensor (an MLP's gate and up halves, two safetensors, are one), as
    # `dgemma convert` counts them
    import dgemma_jax
    from dgemma_jax.model.api import param_shapes

    from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json

    cfg = ModelConfig.preset("tiny-2layer", vocab_size=384)
    save_hf(init_params(cfg, 0), cfg, tmp_path / "hf")
    gemma_like_tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    model = dgemma_jax.DiffusionGemma.from_pretrained(str(tmp_path / "hf"), quantize="int8", progress=True)
    err = capsys.readouterr().err
    n = len(jax.tree.leaves(param_shapes(model.config)))
    assert "reading weights into int8: 100%" in err and f"{n}/{n}" in err, err
    assert any(np.dtype(x.dtype) == np.int8 for x in jax.tree.leaves(model.params))
    # off by default: nothing on stderr
    dgemma_jax.DiffusionGemma.from_pretrained(str(tmp_path / "hf"), quantize="int8")
    assert "reading weights" not in capsys.readouterr().err


def test_start_report_on_a_pipe_says_what_loads_and_compiles_and_keeps_a_refused_input_alone():
    import io
    import time

    from dgemma_jax.progress import StartReport

    out = io.StringIO()  # not a terminal: lines, no bars
    report = StartReport(out, announce_after=0.2)
    with report.loading("a slow model") as wrap:
        assert list(wrap(range(5))) == list(range(5))  # the loaders' progress= wrapper, counting
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    assert lines[0] == "dgemma: loading a slow model ..." and len(lines) == 2, lines
    assert re.fullmatch(r"dgemma: loaded a slow model in \d+\.\d s, 5 tensors read", lines[1]), lines
    with report.compiling():
        jax.jit(lambda y: y * 3 + 1)(jnp.ones(3)).block_until_ready()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("dgemma: ") and "program(s) compiled in" in last, out.getvalue()
    # a quick load's line waits for the run to go on: an input refused right after it stays the only line
    quiet = io.StringIO()
    report = StartReport(quiet)
    with report.loading("a quick model"):
        pass
    with pytest.raises(ValueError):
        with report.compiling():
            raise ValueError("the prompt is too long")
    assert quiet.getvalue() == ""
    with report.compiling():  # the next call that runs says it
        pass
    assert quiet.getvalue().startswith("dgemma: loaded a quick model in ")
    off = io.StringIO()
    with StartReport(off, enabled=False).loading("x") as wrap:
        assert wrap is None
    assert off.getvalue() == ""
