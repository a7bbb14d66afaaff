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
    assert a.step_program() is b.step_program()
    own = Engine(CFG, params, sampler, programs=ProgramCache(2))
    assert own.step_program() is not a.step_program()
    first = own.step_program()
    own.commit_program()
    own.fused_program(16)  # a third program: the least recently used one (the step) is dropped
    assert len(own._program_cache) == 2
    assert own.step_program() is first  # the engine kept it
    fresh = Engine(CFG, params, sampler, programs=own._program_cache)
    assert fresh.step_program() is not first  # made anew: the cache had dropped it
    assert fresh.fused_program(16) is own.fused_program(16)  # still held (it displaced the commit)
    with pytest.raises(ValueError, match="at least one program"):
        ProgramCache(0)
