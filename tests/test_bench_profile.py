"""The denoise-step profiler (benchmarks/step_profile.py) charges each XLA:CPU operation to the right
part of the model and to products or other work."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import step_profile  # noqa: E402


def test_the_hlo_index_tells_products_from_other_work_and_keeps_their_scopes():
    def f(x, w):
        with jax.named_scope("the_product"):
            y = x @ w
        with jax.named_scope("after_it"):
            return jnp.cumsum(jnp.sort(y, axis=-1), axis=0)

    x, w = jnp.ones((64, 32)), jnp.ones((32, 48))
    index = step_profile.hlo_index(jax.jit(f).lower(x, w).compile().as_text())
    products = [r for r in index.values() if r["product"]]
    assert products and all("the_product" in (r["op_name"] or "") for r in products)
    assert any("after_it" in (r["op_name"] or "") and not r["product"] for r in index.values())
    assert not any(r["product"] for r in index.values() if r["opcode"] == "sort")


def test_op_names_of_the_step_map_to_their_parts():
    trunk = "jit(<lambda>)/jit(denoise_step)/Transformer.denoise_features/Transformer._denoise_trunk/"
    cases = {
        trunk + "blocks_3.denoise/blocks_3._ffw/moe/experts_capacity/cond/branch_1_fun/ecd,edf->ecf/dot_general":
            "experts: products and gating",
        trunk + "blocks_0.denoise/blocks_0._ffw/moe/router/top_k": "MoE router",
        trunk + "blocks_2.denoise/attn.denoise/attn._qkv/qkv_proj/btd,dnh->btnh/dot_general":
            "attention q/k/v/o projections",
        trunk + "blocks_2.denoise/attn.denoise/attn._qkv/k_norm/reduce_sum": "attention q/k norms and rope",
        trunk + "blocks_5.denoise/attn.denoise/exp": "attention scores, softmax, values",
        trunk + "blocks_4.denoise/blocks_4._ffw/dense_mlp/...d,dcf->...cf/dot_general": "dense MLP",
        trunk + "sc_mlp/dense_mlp/...f,fd->...d/dot_general": "self-conditioning MLP",
        trunk + "blocks_1.denoise/post_attn_norm/rsqrt": "layer norms and residuals",
        "jit(<lambda>)/jit(denoise_step)/head_sampler_pass/while/body/exp": "head and sampler pass (vocab chunks)",
        "jit(<lambda>)/jit(denoise_step)/select_n": "sampler: accept, renoise, stop test, history",
    }
    for op_name, part in cases.items():
        assert step_profile.part_of(op_name) == part, op_name
    assert step_profile.part_of(None, "copy") == "copies XLA inserted (no source)"
    assert step_profile.part_of(None, "fusion") == "unattributed"


def test_a_traced_step_is_attributed_to_the_model_parts(tmp_path):
    # in a child process: the profiler session stays out of this test process (a later test here aborted
    # inside JAX's persistent compilation cache write after an in-process trace)
    out = tmp_path / "profile.json"
    script = os.path.join(os.path.dirname(step_profile.__file__), "step_profile.py")
    subprocess.run([sys.executable, script, "--preset", "tiny-2layer", "--context", "24", "--canvas", "16",
                    "--calls", "2", "--out", str(out)], check=True, capture_output=True, timeout=600,
                   env={**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
                        "JAX_PLATFORMS": "cpu"})  # and no persistent compilation cache there either
    res = json.loads(out.read_text())
    step = res["step"]
    parts = step["parts"]
    for part in ("head and sampler pass (vocab chunks)", "experts: products and gating", "dense MLP",
                 "attention scores, softmax, values", "attention q/k/v/o projections",
                 "sampler: accept, renoise, stop test, history"):
        assert part in parts and parts[part]["ops"] > 0, part
    assert "unattributed" not in parts  # every executed operation found its source
    assert parts["dense MLP"]["products_ms"] > 0 and parts["sampler: accept, renoise, stop test, history"]["other_ms"] > 0
    total = sum(r["products_ms"] + r["other_ms"] for r in parts.values())
    assert np.isclose(total, step["leaf_ms"]) and step["products_ms"] > 0 and step["other_ms"] > 0
    assert step["wall_ms_median"] > 0
    assert "| dense MLP |" in out.with_suffix(".md").read_text()
