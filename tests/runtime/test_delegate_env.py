"""lavapipe compiles shaders without LLVM's optimisation passes unless the user says otherwise."""
import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.delegate import LAVAPIPE_PERF, delegate_env


def _lavapipe_env(base: dict) -> dict:
    try:
        env, name = delegate_env(base=base, driver="lavapipe")
    except PocketdiffError as e:
        pytest.skip(f"no lavapipe here: {e}")
    assert name == "lavapipe"
    return env


def test_lavapipe_checks_skip_llvm_optimisation_by_default():
    assert _lavapipe_env({})["GALLIVM_PERF"] == LAVAPIPE_PERF == "nopt"


def test_a_users_gallivm_perf_wins():
    assert _lavapipe_env({"GALLIVM_PERF": "no_quad_lod"})["GALLIVM_PERF"] == "no_quad_lod"


def test_the_system_driver_is_left_alone():
    env, name = delegate_env(base={}, driver="system")
    assert name == "system" and "GALLIVM_PERF" not in env
