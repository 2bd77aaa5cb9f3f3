"""What both front ends of fedlap_jax share: the named configs and their command-line
overrides, the data sets and partitions, the library config and run built from a config,
checkpoints and the compilation caches.

``experiments`` (the command line, ``python -m experiments.run`` from a checkout) and
``fedlap_flower`` (the Flower app) import it; it imports neither.
"""
