"""The top floor: one module per tool subcommand of ``python -m lightning_mlopt``, each a ``main(argv) -> int``.

``plan`` (memory per strategy), ``checkpoint`` (list, verify, consolidate, export), ``sweep`` (hyperparameter
sweeps), ``slurm`` (an sbatch script that requeues), ``profile`` (where the step time goes). They share one
preamble (``_preamble.py``: the parser, the ``fit`` arguments passed on, bad input as exit 2). Tools may import
anything in the package, the CLI included; nothing in the package imports a tool (``cli/commands.py`` names them
as strings, and the entry point loads the one asked for).
"""
