"""Launch helpers behind ``python -m lightning_mlopt sweep`` and ``python -m lightning_mlopt slurm``."""
