"""Keras' global random state after a restore: the next unseeded ``keras.random`` draw
is the one the uninterrupted run makes, whether or not a global seed generator existed
when the state was saved, and whether or not one exists before the restore."""

import os

import keras
import numpy as np
import pytest
from kit import mlp

import keras_stable_state as kss
from keras_stable_state import _keras_compat


def _draws(n=3):
    return np.asarray(keras.random.normal((n,)))


def _fresh_globals(seed):
    keras.utils.set_random_seed(seed)
    _keras_compat.set_global_seed_generator(None)


@pytest.mark.parametrize("generator_at_save", [False, True])
@pytest.mark.parametrize("generator_before_restore", [False, True])
def test_next_unseeded_draw_after_a_restore_is_the_uninterrupted_one(
    tmp_path, generator_at_save, generator_before_restore
):
    path = os.path.join(tmp_path, "s.h5")
    model = mlp()
    _fresh_globals(1)
    if generator_at_save:
        _draws(1)  # makes the global seed generator and moves it
    kss.save_training_state(path, model)
    uninterrupted = _draws()

    _fresh_globals(99)
    if generator_before_restore:
        _draws(5)
    kss.restore_training_state(path, model)
    assert (_keras_compat.global_seed_generator() is not None) == generator_at_save
    np.testing.assert_array_equal(_draws(), uninterrupted)


def test_a_refused_restore_leaves_the_global_seed_generator_in_place(tmp_path, monkeypatch):
    """All-or-nothing: a restore refused after the random state was set puts the
    process's own generator back (here: one the saved state would have removed)."""
    path = os.path.join(tmp_path, "s.h5")
    model = mlp()
    _fresh_globals(1)
    kss.save_training_state(path, model)

    _fresh_globals(7)
    _draws(2)
    generator = _keras_compat.global_seed_generator()
    before = np.asarray(generator.state.value).copy()
    expected = _draws()
    generator.state.assign(before)

    from keras_stable_state._core import plan

    original = plan.rng_step

    def failing_after(parsed):
        step = original(parsed)
        inner = step.apply

        def apply():
            inner()
            assert _keras_compat.global_seed_generator() is None  # the saved state removed it
            raise RuntimeError("injected after the random state was set")

        step.apply = apply
        return step

    monkeypatch.setattr(plan, "rng_step", failing_after)
    with pytest.raises(RuntimeError, match="injected"):
        kss.restore_training_state(path, model)
    assert _keras_compat.global_seed_generator() is generator
    np.testing.assert_array_equal(_draws(), expected)
