"""Everything of ``fedlap_flower`` that rests on Flower's internals, and its start-up check.

Flower's public API (``flwr.app``, ``flwr.clientapp``, ``flwr.serverapp``) is
what the ClientApp, ServerApp and strategy use. What a client node and the
ServerApp's reply collection need beyond it lives here, and only here (no
module of ``fedlap_flower`` outside this package imports ``flwr.supercore``,
``flwr.proto``, ``flwr.supernode`` or ``flwr.superlink``):

* :mod:`~fedlap_flower.runtime.support` -- the Flower versions this code was
  tested with (:data:`~fedlap_flower.runtime.support.TESTED_FLOWER_VERSIONS`)
  and the check, name by name, of what each part below uses;
* :mod:`~fedlap_flower.runtime.supernode` -- the node's processes: Flower's
  SuperNode with quicker polling and a SuperExec secret, and the worker;
  Flower's own ``flower-supernode`` when the check fails;
* :mod:`~fedlap_flower.runtime.warm_clientapp` -- the long-lived ClientApp
  process (Flower's ``flwr-clientapp`` protocol, SuperExec authentication,
  ``flwr stop``, the run's signature and replay check);
* :mod:`~fedlap_flower.runtime.object_pulls` -- quicker retries of arrays not
  yet on the SuperLink (the SuperNode's and the ServerApp Grid's);
* :mod:`~fedlap_flower.runtime.serverapp` -- the server's ServerApp executor: only the
  installed ServerApp runs, never a bundle's code;
* :mod:`~fedlap_flower.runtime.run_signature` -- the operator's signature over
  the bundle ``flwr run`` builds and the run config the SuperNodes fuse.
"""
