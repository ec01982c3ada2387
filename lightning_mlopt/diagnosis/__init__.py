"""Small units that judge what a training step produced: spikes, where a NaN was born, transient or not.

They hold no Trainer; the callbacks feed them values every rank agreed on. One exception runs a collective:
``module_norms.ModuleNorms.update_ratios`` all-reduces its one packed vector when the model is sharded, and every
rank calls it (GradNormMonitor does, on logging steps).
"""
