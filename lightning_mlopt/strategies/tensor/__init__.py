"""Tensor parallelism (and FSDP or HSDP x TP): the strategy, its plan's styles, head counts and the split loss."""
