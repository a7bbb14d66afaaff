"""Accept and stop rules plugged into `SamplerConfig` (`dgemma_jax.sampling.rules`)."""

import dataclasses

import numpy as np
import pytest

from dgemma_jax import Engine, ModelConfig, SamplerConfig, init_params
from dgemma_jax.io.model_dir import load_model, save_model
from dgemma_jax.sampling import rules

CFG = ModelConfig.preset("tiny-2layer")
TOKENS = np.array([[5, 9, 12, 7, 3, 8], [4, 4, 10, 11, 0, 0]], np.int32)
LENGTHS = np.array([6, 4], np.int32)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def _sampler(**kw):
    return SamplerConfig(canvas_length=16, max_denoising_steps=8, eos_ids=(1,), **kw)


def _run(params, sampler, **kw):
    out = Engine(CFG, params, sampler, compilation_cache=False).generate(TOKENS, LENGTHS, rng=3, max_new_tokens=32,
                                                                         **kw)
    return np.asarray(out.tokens), np.asarray(out.steps)


@dataclasses.dataclass(frozen=True)
class AcceptAll:
    def __call__(self, view):
        return view.entropy == view.entropy


@dataclasses.dataclass(frozen=True)
class StopAt:
    step: int

    def __call__(self, view):
        return view.step >= self.step


def test_an_accept_rule_decides_what_stays(params):
    # accepting everything is what the entropy bound does when nothing can exceed it
    all_kept = _run(params, _sampler(accept=AcceptAll()))
    huge_bound = _run(params, _sampler(entropy_bound=1e9))
    np.testing.assert_array_equal(all_kept[0], huge_bound[0])
    np.testing.assert_array_equal(all_kept[1], huge_bound[1])
    default = _run(params, _sampler())
    assert not np.array_equal(default[0], all_kept[0])  # the rule is the one the step runs


def test_a_stop_rule_ends_canvases_and_the_budget_still_binds(params):
    tokens, steps = _run(params, _sampler(stop=StopAt(3)))
    ran = steps[steps > 0]
    assert ran.size and (ran == 3).all()
    # a rule that never stops: every canvas runs its budget
    _, steps = _run(params, _sampler(stop=StopAt(10 ** 6)))
    assert (steps[steps > 0] == 8).all()
    # any of several rules: the earliest wins; with the released rule it equals the released sampler
    _, steps = _run(params, _sampler(stop=rules.AnyOf((rules.StableAndConfident(), StopAt(2)))))
    assert (steps[steps > 0] <= 2).all()
    np.testing.assert_array_equal(_run(params, _sampler(stop=rules.AnyOf((rules.StableAndConfident(),))))[0],
                                  _run(params, _sampler())[0])


def test_rules_must_be_hashable_callables_and_are_not_settings(tmp_path, params):
    with pytest.raises(ValueError, match="SamplerConfig.stop must be a callable"):
        _sampler(stop=0.5)

    class Unhashable:
        __hash__ = None

        def __call__(self, view):
            return view.step > 0

    with pytest.raises(ValueError, match="SamplerConfig.accept must be hashable"):
        _sampler(accept=Unhashable())
    with pytest.raises(ValueError, match="AnyOf takes a non-empty tuple"):
        rules.AnyOf(())
    custom = _sampler(stop=StopAt(3))
    with pytest.raises(ValueError, match="cannot be stored as settings"):
        custom.settings()
    save_model(tmp_path / "m", CFG, params, sampler=_sampler())
    assert load_model(tmp_path / "m")[2] == _sampler()
    with pytest.raises(ValueError, match="cannot be stored as settings"):
        save_model(tmp_path / "n", CFG, params, sampler=custom)


def test_a_server_runs_the_engines_rules_and_refuses_a_default_with_others(params):
    from dgemma_jax.serving.scheduler import Scheduler

    engine = Engine(CFG, params, _sampler(), compilation_cache=False)
    with pytest.raises(ValueError, match="default_sampler must share the engine sampler's.*accept, stop"):
        Scheduler(engine, None, default_sampler=_sampler(stop=StopAt(3)))
    assert Scheduler(engine, None, default_sampler=_sampler(t_max=1.2)).default_sampler.t_max == 1.2
