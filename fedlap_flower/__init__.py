"""FedLAP and FedLAP-DP as a Flower app: one client per process or machine.

The library :mod:`fedlap_jax` never imports ``flwr``; this package is the
bridge. Modules without ``flwr`` (importable without the ``flower`` extra):

* :mod:`fedlap_flower.settings` -- the app's run config and node config
  (``config = "quickstart:dp"``, ``overrides``, ``partition-id``, ...) mapped
  onto the experiments' named ml_collections configs.
* :mod:`fedlap_flower.task` -- a party's run (library config, calibrated DP
  mechanism, model and keys, built by :mod:`experiments.build` as for
  ``experiments.run``), the round keys, one client's data partition, the
  server's test split.
* :mod:`fedlap_flower.client_work` -- one client's round: the library's
  :func:`fedlap_jax.client_step` (or :func:`fedlap_jax.baselines.client_step`
  for the FedAvg baseline) on the client's start set, and its reply.
* :mod:`fedlap_flower.server_work` -- the server's round: the replies stacked
  for the method's server step (:attr:`fedlap_jax.method.Method.server_step`; FedLAP's
  synthetic sets padded to one size first), and the test evaluation.
* :mod:`fedlap_flower.method_work` -- a registry method's round cut at the wire, generic over
  the method: its state, plan, client and server steps.

A FedLAP client sends its synthetic set and radius (and its DP metrics); with
``server.start='fedavg_delta'`` (the hybrid DP recipe, ``quickstart:dp``) also
its model delta, one array per parameter leaf (:mod:`fedlap_flower.records`).
* :mod:`fedlap_flower.ledger` -- a client's own privacy ledger, secret key and
  carried client state, persisted atomically in its state directory.
* :mod:`fedlap_flower.federated_runs` -- the federated run a client's carried
  state belongs to (one identity across the run's resumes), in its state directory.
* :mod:`fedlap_flower.replies` -- what a client's reply may hold (shapes,
  dtypes, labels, slot count, image range, delta norm, metrics): the checks
  the server runs on every reply.
* :mod:`fedlap_flower.binding` -- which node holds which partition
  (``partition-keys``, or first come).
* :mod:`fedlap_flower.signed_runs` -- the signed runs a client computed (each
  signature admits one run), in its state directory.

Modules built on ``flwr`` (``pip install -e ".[experiments,flower]"``):

* :mod:`fedlap_flower.records` -- parameters, synthetic sets and keys as
  Flower records.
* :mod:`fedlap_flower.strategy` -- :class:`~fedlap_flower.strategy.FedLAP`, a
  ``flwr.serverapp.strategy.Strategy``.
* :mod:`fedlap_flower.client_app`, :mod:`fedlap_flower.server_app` -- the
  ``ClientApp`` and ``ServerApp`` (the Flower app project is
  ``fedlap_flower/app/``: ``flwr run fedlap_flower/app ...``).
* :mod:`fedlap_flower.node` -- a client's node (``python -m fedlap_flower.node``).
* :mod:`fedlap_flower.runtime` -- everything built on Flower's internals (not its
  public API): the node's SuperNode and long-lived ClientApp worker, the run
  signature, the Grid's quicker pulls, each checked at start-up against the
  Flower versions it was tested with (:mod:`fedlap_flower.runtime.support`).
"""

__all__ = ["settings", "task", "client_work", "server_work", "ledger", "replies", "binding"]
