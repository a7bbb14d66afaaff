"""The engines' program cache (`engine.ProgramCache`): shared jits, bounded, owned by an object."""

import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine import Engine
from dgemma_jax.sampling import SamplerConfig

CFG = ModelConfig.preset("tiny-2layer")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def _sampler():
    return SamplerConfig(canvas_length=16, max_denoising_steps=6, eos_ids=(1,))


def test_engines_share_programs_through_a_bounded_program_cache(params):
    """Engines with equal configs, samplers and runtimes take the same jitted program from the shared
    `ProgramCache`; an engine given its own cache does not; a cache keeps at most `size` programs,
    dropping the least recently used, and an engine keeps the programs it already took."""
    from dgemma_jax.engine import ProgramCache

    sampler = _sampler()
    a, b = Engine(CFG, params, sampler), Engine(CFG, params, sampler)
    assert a.programs.denoise_step is b.programs.denoise_step
    assert a.fused_program(16) is b.fused_program(16)
    own = Engine(CFG, params, sampler, programs=ProgramCache(2))
    assert own.fused_program(16) is not a.fused_program(16)
    first = own.fused_program(16)
    own.fused_program(32)
    own.fused_program(48)  # a third program: the least recently used one (16 tokens) is dropped
    assert len(own._program_cache) == 2
    assert own.fused_program(16) is first  # the engine kept it
    fresh = Engine(CFG, params, sampler, programs=own._program_cache)
    assert fresh.fused_program(16) is not first  # made anew: the cache had dropped it
    assert fresh.fused_program(48) is own.fused_program(48)  # still held (it displaced the 32)
    with pytest.raises(ValueError, match="at least one program"):
        ProgramCache(0)
