"""The step compiler behind ``Strategy.run`` and ``Strategy.explain``.

:mod:`~strategies.step.args` sorts a step's arguments (NNX nodes, arrays,
static values), :mod:`~strategies.step.cache` keeps compiled steps the way
``jax.jit`` does (bounded, weak on functions and models), and
:mod:`~strategies.step.compiler` turns single-device code into one
``jax.jit`` laid out by a strategy's policies.
"""
