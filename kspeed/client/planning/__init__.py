"""An epoch's plan: the sampler's order split among this rank and the servers, laid out in the
ring, and the samplers KSpeed draws it from.

Runs in the training process.
"""
