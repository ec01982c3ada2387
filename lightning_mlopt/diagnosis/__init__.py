"""Small units that judge what a training step produced: spikes against recent history, where a NaN was born.

They hold no Trainer and run no collective; the callbacks feed them values every rank agreed on.
"""
