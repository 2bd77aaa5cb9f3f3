"""A local Flower federation as real processes: SuperLink, SuperNodes, ``flwr run``.

A test and benchmark harness, not part of the package: the tests import it as
``flower_federation`` (``tests/`` is on their path), ``benchmarks/flower_runs.py``
from this directory. It starts the installed ``fedlap_flower`` (whatever
``import fedlap_flower`` finds: the source tree or a built wheel). Each process runs in
its own session (process group), so stopping it also stops the ServerApp /
ClientApp processes it spawned. :class:`Federation` is a context manager whose
exit always stops everything it started (SIGTERM, then SIGKILL after a few
seconds).

* ``Federation(workdir, simulation=False)``: ``flower-superlink --insecure``
  on a free localhost port; :meth:`Federation.start_supernode` starts a client
  node (:mod:`fedlap_flower.node`: ``flower-supernode --isolation process`` and
  its long-lived ClientApp process, ``--insecure --allow-unsigned-runs``) with a
  node config (partition, state dir, max epsilon); ``stock=True`` starts Flower's
  own ``flower-supernode`` instead (subprocess isolation, a ClientApp process
  per message);
  :meth:`Federation.kill_supernode` kills one (SIGKILL: a crash).
* ``Federation(workdir, hardened=True)``: README.md's deployment on one
  machine. Test certificates (:func:`make_test_certificates`); the SuperLink with TLS
  and SuperNode authentication on ``127.0.0.1``; its nginx front
  (``deploy/superlink_front.nginx.conf``) on ``127.0.0.2``, the stand-in for
  the server's public address; each node registered by the operator
  (``flwr supernode register``, on ``127.0.0.1``), connecting through the front
  with its key and trusting the operator's signing key
  (:meth:`Federation.operator_key`); :meth:`Federation.run` signs every run.
  ``front=False``: the same without nginx, the nodes connecting to the
  SuperLink on ``127.0.0.1`` (TLS, SuperNode authentication, signed runs).
* ``Federation(workdir, simulation=True)``: ``flower-superlink --simulation``;
  ``flwr run`` then runs the app on ``num-supernodes`` virtual clients with the
  simulation engine (Ray).
* :meth:`Federation.run` submits ``fedlap_flower/app`` with a run config
  (``flwr run APP NAME --run-config FILE.toml``) through a Flower configuration
  in ``workdir/flwr_home`` (``FLWR_HOME``), never the user's ``~/.flwr``;
  :meth:`Federation.wait` polls ``flwr list`` until the run finishes.

README.md, "Running across machines with Flower", is the hardened deployment.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Mapping

import fedlap_flower
from fedlap_flower.runtime.run_signature import _toml_value, write_toml
from local_network import free_port

PACKAGE_DIR = Path(fedlap_flower.__file__).resolve().parent
APP_DIR = PACKAGE_DIR / "app"
FRONT_TEMPLATE = PACKAGE_DIR / "deploy" / "superlink_front.nginx.conf"
# The server's public address in a hardened federation on one machine (see the docstring).
PUBLIC_HOST = "127.0.0.2"


def make_test_certificates(directory: Path) -> dict[str, Path]:
  """A test CA and a server certificate for ``localhost``, 127.0.0.1 and :data:`PUBLIC_HOST`.

  Returns the paths ``ca`` (CA certificate), ``cert`` and ``key`` (the server's).
  """
  from cryptography import x509  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives import hashes, serialization  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=g-import-not-at-top
  from cryptography.x509.oid import NameOID  # pylint: disable=g-import-not-at-top

  directory.mkdir(parents=True, exist_ok=True)
  now = datetime.datetime.now(datetime.timezone.utc)

  def cert(subject, key, issuer, issuer_key, extensions):
    b = (
      x509.CertificateBuilder()
      .subject_name(subject)
      .issuer_name(issuer)
      .public_key(key.public_key())
      .serial_number(x509.random_serial_number())
      .not_valid_before(now - datetime.timedelta(hours=1))
      .not_valid_after(now + datetime.timedelta(days=2))
    )
    for ext, critical in extensions:
      b = b.add_extension(ext, critical=critical)
    return b.sign(issuer_key, hashes.SHA256())

  ca_key = ec.generate_private_key(ec.SECP384R1())
  ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedlap test CA")])
  ca = cert(
    ca_name, ca_key, ca_name, ca_key, [(x509.BasicConstraints(ca=True, path_length=0), True)]
  )
  key = ec.generate_private_key(ec.SECP384R1())
  san = x509.SubjectAlternativeName(
    [
      x509.DNSName("localhost"),
      x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
      x509.IPAddress(ipaddress.ip_address(PUBLIC_HOST)),
    ]
  )
  server = cert(
    x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]),
    key,
    ca_name,
    ca_key,
    [(san, False), (x509.BasicConstraints(ca=False, path_length=None), True)],
  )
  paths = {
    "ca": directory / "ca.crt",
    "cert": directory / "server.pem",
    "key": directory / "server.key",
  }
  paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
  paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
  paths["key"].write_bytes(
    key.private_bytes(
      serialization.Encoding.PEM,
      serialization.PrivateFormat.TraditionalOpenSSL,
      serialization.NoEncryption(),
    )
  )
  os.chmod(paths["key"], 0o600)
  return paths


def ssh_key_pair(path: Path, kind: str) -> Path:
  """An OpenSSH key pair ``path`` / ``path.pub`` (``kind``: ``ecdsa`` P-384, SuperNode
  keys; ``ed25519``, signing keys), as ``ssh-keygen -t KIND`` writes them."""
  from cryptography.hazmat.primitives import serialization  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives.asymmetric import ec, ed25519  # pylint: disable=g-import-not-at-top

  key = (
    ec.generate_private_key(ec.SECP384R1())
    if kind == "ecdsa"
    else ed25519.Ed25519PrivateKey.generate()
  )
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(
    key.private_bytes(
      serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
  )
  os.chmod(path, 0o600)
  Path(f"{path}.pub").write_bytes(
    key.public_key().public_bytes(
      serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    + b"\n"
  )
  return path


def node_config_arg(values: Mapping[str, Any]) -> str:
  """``--node-config`` text: ``key=value`` pairs, strings quoted."""
  return " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())


def nginx_path() -> str | None:
  """The installed nginx (``PATH``, else Debian's ``/usr/sbin/nginx``), ``None`` without one."""
  nginx = shutil.which("nginx") or "/usr/sbin/nginx"
  return nginx if os.path.exists(nginx) else None


class Federation:
  """Processes of a local federation (see the module docstring)."""

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    simulation: bool = False,
    hardened: bool = False,
    front: bool = True,
    env: Mapping[str, str] | None = None,
    bin_dir: str | None = None,
  ):
    if hardened and simulation:
      raise ValueError("hardened=True is a deployment; the simulation engine has no SuperNodes")
    self.workdir = Path(workdir).resolve()  # FLWR_HOME must not depend on the cwd
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.simulation = simulation
    self.hardened = hardened
    self.use_front = hardened and front
    self.last_run_config: Path | None = None
    self.certs: dict[str, Path] | None = None
    self.public_port: int | None = None
    self.front: subprocess.Popen | None = None
    self.bin = Path(bin_dir or os.path.dirname(sys.executable))
    self.port = free_port()
    self.env = {
      **os.environ,
      **(env or {}),
      "FLWR_HOME": str(self.workdir / "flwr_home"),
      "FLWR_DISABLE_UPDATE_CHECK": "1",
      "FLWR_TELEMETRY_ENABLED": "0",
      "PYTHONUNBUFFERED": "1",
    }
    # The SuperLink starts flower-superexec by name: find it next to flower-superlink
    # even when the virtual environment was not activated.
    self.env["PATH"] = os.pathsep.join([str(self.bin), self.env.get("PATH", "")])
    self.superlink: subprocess.Popen | None = None
    self.executor: subprocess.Popen | None = None
    self.supernodes: dict[int, subprocess.Popen] = {}
    self.node_configs: dict[int, dict] = {}
    self.runtime_ports: dict[int, int] = {}
    self._logs: list = []

  # -- processes -----------------------------------------------------------------

  def _spawn(
    self,
    args: list[str],
    log_name: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
  ) -> subprocess.Popen:
    log = open(self.workdir / log_name, "ab")
    self._logs.append(log)
    return subprocess.Popen(
      args,
      stdout=log,
      stderr=subprocess.STDOUT,
      env={**self.env, **(env or {})},
      cwd=str(cwd or self.workdir),
      start_new_session=True,
    )

  def start(self, timeout: float = 60.0) -> "Federation":
    """Starts the SuperLink (and, hardened, its front) and waits until they answer."""
    args = [
      str(self.bin / "flower-superlink"),
      "--host",
      "127.0.0.1",
      "--port",
      str(self.port),
      "--disable-runtime-dependency-installation",
    ]
    if self.hardened:
      self.certs = make_test_certificates(self.workdir / "certs")
      args += [
        "--ssl-ca-certfile",
        str(self.certs["ca"]),
        "--ssl-certfile",
        str(self.certs["cert"]),
        "--ssl-keyfile",
        str(self.certs["key"]),
        "--enable-supernode-auth",
      ]
    else:
      args.append("--insecure")
    if self.simulation:
      args.append("--simulation")
    if self.hardened:  # the ServerApp runs from fedlap_flower's executor, never a bundle's code
      secret = self.workdir / "superexec.secret"
      secret.write_bytes(os.urandom(32))
      secret.chmod(0o600)
      args += ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    self.superlink = self._spawn(args, "superlink.log")
    if self.hardened:
      self.executor = self._spawn(
        [sys.executable, "-m", "fedlap_flower.runtime.serverapp", "--runtime-api-address"]
        + [f"127.0.0.1:{self.port}", "--root-certificates", str(self.certs["ca"])]
        + ["--superexec-auth-secret-file", str(secret)],
        "serverapp.log",
      )
    context = None
    if self.hardened:
      context = ssl.create_default_context(cafile=str(self.certs["ca"]))
    scheme = "https" if self.hardened else "http"
    self._wait_until(
      lambda: _answers(f"{scheme}://127.0.0.1:{self.port}/health", context),
      self.superlink,
      "flower-superlink",
      "superlink.log",
      timeout,
    )
    home = self.workdir / "flwr_home"
    home.mkdir(exist_ok=True)
    if self.hardened:
      ca = json.dumps(str(self.certs["ca"]))
      text = (
        '[superlink]\ndefault = "test"\n\n'
        f'[superlink.test]\naddress = "127.0.0.1:{self.port}"\nroot-certificates = {ca}\n'
      )
      if self.use_front:
        self._start_front(timeout)
        text += (
          f'\n[superlink.front]\naddress = "{PUBLIC_HOST}:{self.public_port}"\n'
          f'root-certificates = {ca}\n'
        )
      (home / "config.toml").write_text(text)
    else:
      (home / "config.toml").write_text(
        '[superlink]\ndefault = "test"\n\n'
        f'[superlink.test]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
      )
    return self

  def _wait_until(self, ready, proc, name: str, log: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
      if proc.poll() is not None:
        raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(log)}")
      if ready():
        return
      time.sleep(0.3)
    raise TimeoutError(f"{name} did not answer within {timeout} s: {self.log_tail(log)}")

  def _start_front(self, timeout: float) -> None:
    """nginx from ``deploy/superlink_front.nginx.conf`` on ``PUBLIC_HOST``."""
    nginx = nginx_path()
    if nginx is None:
      raise FileNotFoundError(
        "nginx is not installed (Debian: apt-get install nginx-light); "
        "the hardened federation's front needs it"
      )
    self.public_port = free_port(PUBLIC_HOST)
    front = self.workdir / "front"
    (front / "nginx-tmp").mkdir(parents=True, exist_ok=True)
    conf = FRONT_TEMPLATE.read_text()
    for k, v in {
      "@DIR@": str(front),
      "@PUBLIC_ADDRESS@": f"{PUBLIC_HOST}:{self.public_port}",
      "@CERT@": str(self.certs["cert"]),
      "@KEY@": str(self.certs["key"]),
      "@CA@": str(self.certs["ca"]),
      "@SUPERLINK_PORT@": str(self.port),
    }.items():
      conf = conf.replace(k, v)
    (front / "nginx.conf").write_text(conf)
    self.front = self._spawn(
      [nginx, "-p", str(front), "-c", str(front / "nginx.conf"), "-g", "daemon off;"], "front.log"
    )

    def up() -> bool:
      try:
        with socket.create_connection((PUBLIC_HOST, self.public_port), timeout=1):
          return True
      except OSError:
        return False

    self._wait_until(up, self.front, "nginx", "front.log", timeout)

  def start_supernode(
    self,
    index: int,
    node_config: Mapping[str, Any] | None = None,
    *,
    trusted: Path | None = None,
    stock: bool = False,
    extra: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
  ) -> subprocess.Popen:
    """Starts client node ``index`` (its own Runtime API port) with ``node_config``.

    Hardened: its key is made and registered by the operator on first start, it
    connects through the front (or to the SuperLink, ``front=False``), and trusts
    ``trusted`` (default: the operator's key). ``stock``: Flower's own
    ``flower-supernode`` (subprocess isolation), not :mod:`fedlap_flower.node`.
    ``extra``: more flags for the node. ``env``: more environment variables for this node's
    processes (the federation's own, then these).
    """
    if node_config is not None:
      self.node_configs[index] = dict(node_config)
    if stock and self.hardened:
      raise ValueError("stock=True runs unsigned runs only (Flower's own check refuses ours)")
    command = (
      [str(self.bin / "flower-supernode")]
      if stock
      else [sys.executable, "-m", "fedlap_flower.node"]
    )
    self.runtime_ports[index] = free_port()
    args = [
      *command,
      *extra,
      "--host",
      "127.0.0.1",
      "--port",
      str(self.runtime_ports[index]),
      "--node-config",
      node_config_arg(self.node_configs[index]),
    ]
    if self.hardened:
      key = self.workdir / "keys" / f"node_{index}"
      if not key.exists():
        ssh_key_pair(key, "ecdsa")
        res = self.register(Path(f"{key}.pub"))
        if '"success": true' not in res.stdout:
          raise RuntimeError(f"registering node {index} failed: {res.stdout} {res.stderr}")
      superlink = (
        f"{PUBLIC_HOST}:{self.public_port}" if self.use_front else f"127.0.0.1:{self.port}"
      )
      args += [
        "--superlink",
        superlink,
        "--root-certificates",
        str(self.certs["ca"]),
        "--auth-supernode-private-key",
        str(key),
        "--trusted-entities",
        str(trusted or self.trusted_entities()),
      ]
    else:
      args += ["--insecure", "--superlink", f"127.0.0.1:{self.port}"]
      args += [] if stock else ["--allow-unsigned-runs"]
    self.supernodes[index] = self._spawn(args, f"supernode-{index}.log", env=env)
    return self.supernodes[index]

  def register(self, public_key: Path, superlink: str = "test") -> subprocess.CompletedProcess:
    """``flwr supernode register PUBLIC_KEY SUPERLINK`` (``front``: through the front)."""
    return self._flwr(
      "supernode", "register", str(public_key), superlink, "--format", "json", timeout=60
    )

  def operator_key(self) -> Path:
    """The operator's Ed25519 signing key (made on first use)."""
    key = self.workdir / "keys" / "operator"
    if not key.exists():
      ssh_key_pair(key, "ed25519")
    return key

  def trusted_entities(self, key: Path | None = None) -> Path:
    """A trusted-entities YAML naming ``key`` (default: the operator's)."""
    key = key or self.operator_key()
    path = self.workdir / "keys" / f"{key.name}_trusted.yaml"
    path.write_text(f"{key.name}: {json.dumps(Path(f'{key}.pub').read_text().strip())}\n")
    return path

  def kill_supernode(self, index: int) -> None:
    """SIGKILL to SuperNode ``index`` and every process it started (a crash)."""
    proc = self.supernodes.pop(index)
    _signal_group(proc, signal.SIGKILL)
    proc.wait(timeout=10)

  def close(self) -> None:
    """Stops every process this federation started (SIGTERM, then SIGKILL after 5 s)."""
    procs = list(self.supernodes.values()) + [
      p for p in (self.front, self.executor, self.superlink) if p
    ]
    for p in procs:
      _signal_group(p, signal.SIGTERM)
    deadline = time.time() + 5
    for p in procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        pass
      _signal_group(p, signal.SIGKILL)  # also the group's children that ignored SIGTERM
      try:
        p.wait(timeout=5)
      except subprocess.TimeoutExpired:
        pass
    self.supernodes.clear()
    self.superlink = self.front = self.executor = None
    for f in self._logs:
      f.close()
    self._logs.clear()

  def __enter__(self) -> "Federation":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  def log_tail(self, name: str, chars: int = 3000) -> str:
    path = self.workdir / name
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

  # -- runs --------------------------------------------------------------------------

  def _flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
      [str(self.bin / "flwr"), *args],
      capture_output=True,
      text=True,
      env=self.env,
      cwd=str(self.workdir),
      timeout=timeout,
    )

  def run(
    self,
    run_config: Mapping[str, Any],
    *,
    num_supernodes: int | None = None,
    app_dir: Path = APP_DIR,
    signing_key: Path | None = None,
  ) -> int:
    """Submits the app with ``run_config``; returns the run id.

    Hardened, the run is signed (:mod:`fedlap_flower.runtime.run_signature`) with
    ``signing_key`` (default: the operator's).
    """
    path = write_toml(self.workdir / f"run_config_{time.time_ns()}.toml", run_config)
    if self.hardened:
      from fedlap_flower.runtime import run_signature  # pylint: disable=g-import-not-at-top

      write_toml(
        path,
        run_signature.signed_overrides(signing_key or self.operator_key(), app_dir, [str(path)]),
      )
    self.last_run_config = path
    return self.submit(path, num_supernodes=num_supernodes, app_dir=app_dir)

  def submit(
    self, path: Path, *, num_supernodes: int | None = None, app_dir: Path = APP_DIR
  ) -> int:
    """``flwr run APP test --run-config PATH`` as it is (a signed TOML submitted again);
    returns the run id."""
    args = ["run", str(app_dir), "test", "--run-config", str(path), "--format", "json"]
    if self.simulation:
      args += ["--federation-config", f"num-supernodes={num_supernodes or 2}"]
    res = self._flwr(*args)
    try:
      payload = json.loads(res.stdout[res.stdout.index("{") :])
      return int(payload["run-id"])
    except (ValueError, KeyError, TypeError):
      raise RuntimeError(
        f"flwr run failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-2000:]}"
      ) from None

  def status(self, run_id: int) -> str:
    """The run's status as ``flwr list --run-id`` reports it (e.g. ``finished:completed``),
    asked of the SuperLink's Control API from this process with the client ``flwr list`` uses:
    a ``flwr`` process a poll costs about a CPU-second, which the federation's own processes
    need."""
    from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
    from flwr.common.serde import run_from_proto
    from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    client = ControlHttpClient.from_server_address(
      server_address=f"127.0.0.1:{self.port}",
      insecure=not self.hardened,
      root_certificates=self.certs["ca"].read_bytes() if self.hardened else None,
      interceptors=[
        CliClientHttpInterceptor(),
        RuntimeVersionHttpInterceptor(component_name="flwr CLI"),
      ],
    )
    try:
      runs = client.ListRuns(ListRunsRequest(run_id=run_id)).run_dict.values()
    except Exception:  # pylint: disable=broad-except  # not listed (yet): as flwr list fails
      return "unknown"
    finally:
      client.close()
    for run in map(run_from_proto, runs):
      status = run.status
      return f"{status.status}:{status.sub_status}" if status.sub_status else status.status
    return "unknown"

  def wait(self, run_id: int, timeout: float, poll: float = 3.0) -> str:
    """Waits until the run finished; returns its final status (``finished:...``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      status = self.status(run_id)
      if status.startswith("finished"):
        return status
      if self.superlink is not None and self.superlink.poll() is not None:
        raise RuntimeError(f"flower-superlink died: {self.log_tail('superlink.log')}")
      time.sleep(poll)
    raise TimeoutError(
      f"run {run_id} did not finish within {timeout} s (status "
      f"{self.status(run_id)}); superlink log: "
      f"{self.log_tail('superlink.log')}"
    )

  def logs(self, run_id: int) -> str:
    """The run's ServerApp log as ``flwr log`` shows it."""
    res = self._flwr("log", str(run_id), "test", "--show", timeout=60)
    return res.stdout + res.stderr


def _answers(url: str, context) -> bool:
  try:
    with urllib.request.urlopen(url, timeout=1, context=context) as r:
      return r.status == 200
  except OSError:
    return False


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass
