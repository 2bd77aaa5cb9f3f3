"""Experiment driver for fedlap_jax: named configs, data, training loop, outputs.

``python -m experiments.run --config=NAME [--config.FIELD=VALUE ...] [--workdir=DIR]``
runs one experiment (see :mod:`experiments.run`); ``python -m experiments.report
RUN_DIR ... --out DIR`` tabulates finished runs. All TensorFlow / tfds code of
the project lives in :mod:`fedlap_runs.data`; ``import fedlap_jax`` never imports
it.
"""
