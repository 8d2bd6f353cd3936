"""Real Redis topologies for tests, on free loopback ports: a Redis Cluster (primaries
with replicas, created with ``redis-cli --cluster create``) whose primaries a test can
kill to force a failover, and a TLS + ACL Redis with a self-signed certificate."""

from __future__ import annotations

import datetime
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import free_port, free_ports, wait_port


def _redis(*args: str) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (.ci/run installs it)")
    return subprocess.Popen([exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cli(*args: str, timeout: float = 30) -> str:
    out = subprocess.run(
        ["redis-cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return out.stdout + out.stderr


@dataclass
class ClusterNode:
    port: int
    dir: Path
    #: The cluster bus port is port + 10000 unless given: free ports are ephemeral ones,
    #: whose + 10000 may be taken or past 65535.
    bus_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = _redis(
            "--port", str(self.port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-port", str(self.bus_port),
            "--cluster-config-file", str(self.dir / f"nodes-{self.port}.conf"),
            "--cluster-node-timeout", "1500",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            "--logfile", str(self.dir / f"redis-{self.port}.log"),
        )  # fmt: skip
        if not wait_port(self.port, 10):
            raise RuntimeError(f"cluster node {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def info(self, section: str = "replication") -> dict[str, str]:
        text = _cli("-p", str(self.port), "info", section)
        return dict(
            line.split(":", 1) for line in text.splitlines() if ":" in line and "#" not in line
        )


@dataclass
class RedisClusterProcess:
    """``primaries`` primaries, each with one replica."""

    primaries: int = 3
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sg-cluster-")))
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        alive = next(n for n in self.nodes if n.proc is not None)
        return f"redis+cluster://127.0.0.1:{alive.port}/0"

    @property
    def proc(self) -> subprocess.Popen | None:
        """A live node's process, or None when the cluster is stopped (the same
        question ``RedisProcess.proc`` answers)."""
        return next((n.proc for n in self.nodes if n.proc is not None), None)

    def start(self) -> RedisClusterProcess:
        """Create the cluster; after ``stop()``, start the same nodes again (their
        ``nodes.conf`` keeps the topology, as after a whole-cluster power cut)."""
        if self.nodes:
            for n in self.nodes:
                if n.proc is None:
                    n.start()
            self.wait_ok()
            return self
        for attempt in range(3):
            # Ports held open together are distinct: free_port() one at a time may hand
            # out the same port twice, or one another process (a test's Redis) takes.
            ports = free_ports(self.primaries * 4)
            self.nodes = [
                ClusterNode(ports[2 * i], self.dir, bus_port=ports[2 * i + 1])
                for i in range(self.primaries * 2)
            ]
            try:
                for n in self.nodes:
                    n.start()
                out = _cli(
                    "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas", "1", "--cluster-yes",
                    timeout=60,
                )  # fmt: skip
            except RuntimeError as exc:
                out = str(exc)
            if "[OK] All 16384 slots covered" in out:
                self.wait_ok()
                return self
            self.stop()
            for conf in self.dir.glob("nodes-*.conf"):
                conf.unlink()
            if attempt == 2:
                self.close()
                raise RuntimeError(f"redis-cli --cluster create failed: {out[-2000:]}")
        raise AssertionError("unreachable")

    def wait_ok(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.proc is not None]
            if all("cluster_state:ok" in _cli("-p", str(n.port), "cluster", "info") for n in live):
                # A replica that has not finished its first sync cannot be promoted:
                # wait for every replica's link too, or a failover test kills a
                # primary whose replica never takes over.
                infos = [n.info() for n in live]
                if all(i.get("master_link_status", "up") == "up" for i in infos):
                    return
            time.sleep(0.2)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def primary_for(self, key: str) -> ClusterNode:
        """The node that serves ``key`` now (asks the cluster, so it follows failovers)."""
        slot = int(_cli("-p", str(self._any().port), "cluster", "keyslot", key).strip())
        for n in self.nodes:
            if n.proc is not None and self._serves(n, slot):
                return n
        raise RuntimeError(f"no live primary serves slot {slot}")

    def _serves(self, node: ClusterNode, slot: int) -> bool:
        text = _cli("-p", str(node.port), "cluster", "nodes")
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 8 and "myself" in parts[2]:
                for span in parts[8:]:
                    if span.startswith("["):
                        continue
                    lo, _, hi = span.partition("-")
                    if int(lo) <= slot <= int(hi or lo):
                        return True
        return False

    def _any(self) -> ClusterNode:
        return next(n for n in self.nodes if n.proc is not None)

    def flush(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.info().get("role") == "master":
                _cli("-p", str(n.port), "flushall")

    def pause(self) -> None:
        """Hang every node (SIGSTOP): connections open, nothing answers."""
        for n in self.nodes:
            if n.proc is not None:
                n.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill every node (SIGKILL); ``start()`` brings the same cluster back."""
        for n in self.nodes:
            n.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def self_signed(dir: Path) -> tuple[Path, Path]:
    """A CA-less self-signed certificate for 127.0.0.1 (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = dir / "redis.crt", dir / "redis.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@dataclass
class TLSRedisProcess:
    """TLS only (no plaintext port), a self-signed certificate, and an ACL user that
    may run what the gateway runs; the default user is disabled."""

    user: str = "steergate"
    password: str = "s3cret-acl-password"
    port: int = field(default_factory=free_port)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sg-tls-")))
    proc: subprocess.Popen | None = None

    @property
    def ca(self) -> Path:
        return self.dir / "redis.crt"

    @property
    def url(self) -> str:
        return (
            f"rediss://{self.user}:{self.password}@127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca}"
        )

    def start(self) -> TLSRedisProcess:
        cert, key = self_signed(self.dir)
        acl = self.dir / "users.acl"
        acl.write_text(
            "user default off\n"
            f"user {self.user} on >{self.password} ~sg:* &sg:* +@all -@dangerous "
            "+info +flushall\n"
        )
        self.proc = _redis(
            "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
            "--aclfile", str(acl),
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
        )  # fmt: skip
        if not wait_port(self.port, 10):
            raise RuntimeError("TLS redis-server did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
