"""The replica context: per-replica steps, cross-device reductions, distributed values.

tf.distribute's custom-loop surface: a step run once per replica
(:mod:`~strategies.replica.replica_step`), its gradients reduced by a cross-device op
(:mod:`~strategies.replica.cross_device_ops`), ``Strategy.reduce``/``gather``
(:mod:`~strategies.replica.cross_replica`), the values and contexts those pass around
(:mod:`~strategies.replica.values`) and a watchdog for steps hung in a collective.
"""
