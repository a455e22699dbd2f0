"""Where variables go: the sharding rules presets share, and layout at model construction.

:mod:`~strategies.placement.sharding` splits a variable on its largest divisible
dimension; :mod:`~strategies.placement.creation` lays out NNX models as they are
built inside ``strategy.scope()``.
"""
