"""Generator jobs across hosts: the trainer's hub and remote feeder (hub.py), weights between
jobs over JAX's transfer API (weights.py) and the generator job itself (generator_job.py).
Imports rl/ and everything below it."""
