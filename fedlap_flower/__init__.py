"""FedLAP, FedLAP-DP and every federated registry method as a Flower app: one client per
process or machine.

The library :mod:`fedlap_jax` never imports ``flwr``; this package is the
bridge. Modules without ``flwr`` (importable without the ``flower`` extra):

* :mod:`fedlap_flower.settings` -- the app's run config and node config
  (``config = "quickstart:dp"``, ``overrides``, ``partition-id``, ...) mapped
  onto the experiments' named ml_collections configs.
* :mod:`fedlap_flower.task` -- a party's run (library config, calibrated DP
  mechanism, model and keys, built by :mod:`fedlap_runs.build` as for
  ``experiments.run``), the round's participants, one client's data partition, the
  server's test split.
* :mod:`fedlap_flower.method_work` -- a registry method's round cut at the wire, generic over
  the method: its state, plan, client and server steps, and the arrays they travel as.
* :mod:`fedlap_flower.server_work` -- the server's round: the replies stacked
  for the method's server step (:attr:`fedlap_jax.method.Method.server_step`), and the test
  evaluation.

A client sends its method's update by the method's wire (FedLAP: its synthetic set, ``r_k``
and, with ``client.model_steps='noisy_real'``, the hybrid DP recipe of ``quickstart:dp``, its
model delta, one array per parameter leaf; :mod:`fedlap_flower.records`), and its DP metrics.
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

* :mod:`fedlap_flower.records` -- parameters and a method's named arrays as
  Flower records.
* :mod:`fedlap_flower.strategy` -- :class:`~fedlap_flower.strategy.MethodStrategy`, a
  ``flwr.serverapp.strategy.FedAvg`` around the run's registry method.
* :mod:`fedlap_flower.client_app`, :mod:`fedlap_flower.server_app` -- the
  ``ClientApp`` and ``ServerApp`` (the Flower app project is
  ``fedlap_flower/app/``: ``flwr run fedlap_flower/app ...``).
* :mod:`fedlap_flower.node` -- a client's node (``python -m fedlap_flower.node``).
* :mod:`fedlap_flower.runtime` -- everything built on Flower's internals (not its
  public API): the node's SuperNode and long-lived ClientApp worker, the run
  signature, the Grid's quicker pulls, each checked at start-up against the
  Flower versions it was tested with (:mod:`fedlap_flower.runtime.support`).
"""

__all__ = ["settings", "task", "method_work", "server_work", "ledger", "replies", "binding"]
