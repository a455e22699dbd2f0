"""Variable reads inside a traced step: FSDP's gather at each read, casts, remat, host offload.

:mod:`~strategies.reads.param_reads` shapes every parameter read of an NNX model
inside a step (through per-instance class swaps, :mod:`~strategies.reads.swaps`);
:mod:`~strategies.reads.fsdp_ops` holds the gather / reduce-scatter pair,
:mod:`~strategies.reads.mixed_precision` the ``MixedPrecision`` policy and
:mod:`~strategies.reads.offload` variables kept in host memory between steps.
"""
