"""Context parallelism: each sequence split across ranks (``context_parallel_size``), attention over the whole.

The all-to-all method (DeepSpeed-Ulysses): before attention each rank trades its slice of the sequence for a slice
of the heads, attends over the full sequence with any kernel, and trades back (``all_to_all.py``); calls of
``torch.nn.functional.scaled_dot_product_attention`` are routed through it (``sdpa_mode.py``), and every sequence
tensor of a batch is split before the step (``sequence_split.py``). Research and the plan ahead:
``docs/design/context_parallel_research.md``.
"""
