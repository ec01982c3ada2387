"""Pipeline parallelism: the strategy, the model's cut into stages, the schedules, and TP inside stages."""
