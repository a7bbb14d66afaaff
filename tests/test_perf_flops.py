"""The shared FLOP model (dgemma_jax/perf/roofline.py, used by the AOT reports and the CPU benchmarks)
against an independent count: the matrix products of the traced model.

`matmul_flops` walks the jaxpr of a real pass (`model.api`) and sums 2 x output size x contracted
size over every `dot_general` whose operands both have a free dimension (a matrix-vector product,
such as attention's softmax denominator against a vector of ones, is a reduction, not a product the
model counts), and 2 x M x K x N over every `ragged_dot` (the "ragged" expert dispatch runs each
(token, expert) pair through its expert once: exactly the top-k work; "dense" would run all experts
and "capacity" pads buffers). A scan body counts `length` times.
"""

import math

import jax
import jax.numpy as jnp
import pytest

from dgemma_jax.config import GLOBAL, SLIDING, ModelConfig
from dgemma_jax.model import api
from dgemma_jax.model.cache import init_cache, ring_size
from dgemma_jax.perf import roofline
from dgemma_jax.runtime import Runtime

RAGGED = Runtime(moe_dispatch="ragged")


def _subjaxprs(params):
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def matmul_flops(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        shapes = [v.aval.shape for v in eqn.invars]
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = shapes[:2]
            lfree = [d for i, d in enumerate(lhs) if i not in lc and i not in lb]
            rfree = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
            if lfree and rfree:
                total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)
        elif name.startswith("ragged_dot"):
            (m, k), (_, k2, n) = shapes[0], shapes[1]
            assert k == k2
            total += 2 * m * k * n
        elif name == "while":
            raise AssertionError("a while loop's trip count is unknown to this counter")
        else:
            inner = [matmul_flops(j) for j in _subjaxprs(eqn.params)]
            if name == "cond":
                assert len(set(inner)) == 1, inner  # every branch does the same products
                inner = inner[:1]
            total += sum(inner) * (eqn.params["length"] if name == "scan" else 1)
    return total


CONFIGS = [
    # two sliding layers and a global one; 8 experts, top 2; window 16 < context: the sliding
    # layers read window - 1 cached keys, the global one all of them
    (ModelConfig.preset("tiny-6layer"), 2, 40),
    # window 8 > context 5: every layer reads the whole context; 4 experts, top 2
    (ModelConfig.preset("tiny-2layer"), 1, 5),
    # other widths: no dense-MLP-sized numbers in common, 6 experts top 3, global layer first
    (ModelConfig.preset("tiny-2layer", hidden_size=48, num_heads=6, head_dim=8, num_kv_heads=3, global_head_dim=24,
                        intermediate_size=80, num_experts=6, top_k=3, moe_intermediate_size=24, sliding_window=12,
                        canvas_length=8, vocab_size=96, num_layers=3, layer_types=(GLOBAL, SLIDING, SLIDING)),
     3, 30),
]


@pytest.mark.parametrize("cfg,batch,context", CONFIGS, ids=["tiny-6layer", "tiny-2layer", "custom"])
def test_the_denoise_step_flops_are_the_traced_pass_matrix_products(cfg, batch, context):
    cfg = cfg.replace(dtype="float32", param_dtype="float32")
    params = api.param_shapes(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context))  # a cache holding exactly the context
    canvas = jax.ShapeDtypeStruct((batch, cfg.canvas_length), jnp.int32)
    ends = jax.ShapeDtypeStruct((batch,), jnp.int32)
    soft = jax.ShapeDtypeStruct((batch, cfg.canvas_length, cfg.hidden_size), jnp.float32)
    logits = jax.ShapeDtypeStruct((batch, cfg.canvas_length, cfg.vocab_size), jnp.float32)

    def traced(fn, *args):
        return matmul_flops(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr)

    args = (params, canvas, ends, cache, soft)
    trunk = traced(lambda p, c, e, k, s: api.denoise_features(p, cfg, c, e, k, s, runtime=RAGGED), *args)
    with_head = traced(lambda p, c, e, k, s: api.denoise_logits(p, cfg, c, e, k, s, runtime=RAGGED), *args)
    sc_embed = traced(lambda p, x: api.soft_embed_pass(p, cfg, x, runtime=RAGGED), params, logits)

    model = roofline.denoise_step_flops_by_part(cfg, batch, context)
    assert trunk == model["trunk"]
    assert with_head - trunk == model["head_logits"]
    assert sc_embed == model["sc_soft_embedding"]
    assert trunk + (with_head - trunk) + sc_embed == model["total"] == roofline.denoise_step_flops(cfg, batch, context)


def _attention_pairs(cfg, layer, context, new):
    """Query-key pairs a causal pass keeps, counted from the mask: key j <= query i, and on a sliding
    layer i - j < window."""
    pairs = 0
    for i in range(context, context + new):
        for j in range(i + 1):
            pairs += cfg.layer_types[layer] == GLOBAL or i - j < cfg.sliding_window
    return pairs


@pytest.mark.parametrize("cfg,batch,context", CONFIGS, ids=["tiny-6layer", "tiny-2layer", "custom"])
@pytest.mark.parametrize("new,head_tokens", [(24, 0), (1, 1)])
def test_the_causal_pass_flops_are_its_projections_plus_the_masked_attention(cfg, batch, context, new, head_tokens):
    """The model counts the attention pairs the causal mask keeps (useful work); the traced encoder
    pass computes scores over every key it reads (the ring cache + the new block on sliding
    layers, model/cache.py; the whole context + the new block on global ones) and masks the rest. So: attention
    against the mask's pairs, everything else against the traced pass less the keys it reads."""
    cfg = cfg.replace(dtype="float32", param_dtype="float32")
    model = roofline.causal_pass_flops(cfg, batch, context, new, head_tokens)
    per_pair = [2 * 2 * cfg.num_heads * cfg.layer_head_dim(i) for i in range(cfg.num_layers)]
    assert model["attention"] == batch * sum(per_pair[i] * _attention_pairs(cfg, i, context, new)
                                             for i in range(cfg.num_layers))

    params = api.param_shapes(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context + new))
    tokens = jax.ShapeDtypeStruct((batch, new), jnp.int32)
    starts = jax.ShapeDtypeStruct((batch,), jnp.int32)
    mode = "last" if head_tokens else "none"
    encode = jax.make_jaxpr(lambda p, t, s, n, c: api.encode_pass(p, cfg, t, s, n, c, mode, runtime=RAGGED))
    traced = matmul_flops(encode(params, tokens, starts, starts, cache).jaxpr)
    read = [(context if cfg.layer_types[i] == GLOBAL else ring_size(cfg, context + new)) + new
            for i in range(cfg.num_layers)]
    attention_read = batch * new * sum(p * k for p, k in zip(per_pair, read))
    assert traced - attention_read == model["total"] - model["attention"]
    assert model["head_logits"] == 2 * batch * head_tokens * cfg.vocab_size * cfg.hidden_size
