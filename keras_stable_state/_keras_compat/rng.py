"""Keras' global seed generator and the dtype of seed states."""

from __future__ import annotations

__all__ = [
    "global_seed_generator",
    "make_global_seed_generator",
    "random_seed_dtype",
    "set_global_seed_generator",
]


def global_seed_generator():
    """Keras' global ``SeedGenerator`` (``keras.random`` ops without a seed), or ``None``
    when none was made yet."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)


def set_global_seed_generator(gen) -> None:
    """Make ``gen`` (or ``None``) Keras' global seed generator."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, gen)


def make_global_seed_generator():
    """Keras' global seed generator, made if there is none yet."""
    from keras.src.random import seed_generator

    return seed_generator.global_seed_generator()


def random_seed_dtype() -> str:
    """The dtype this backend keeps seed states in."""
    from keras.src.backend import random_seed_dtype as keras_random_seed_dtype

    return keras_random_seed_dtype()
