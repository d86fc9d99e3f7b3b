"""Real Redis servers for the remote tier's benchmark and tests: a standalone ``redis-server`` and
a Redis Cluster (3 masters, optionally with replicas) on loopback ports, started in a given
directory and stopped by whoever started them.  There is no fallback: without ``redis-server``
(Debian package redis-server; scripts/dev.sh installs it) starting one raises RuntimeError."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral() -> tuple[int, int]:
    """The range the kernel draws client connections' local ports from (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too, both outside the
    ephemeral range: a port in it, free when checked, was taken by some client connection's
    local end before the server bound it ("Address already in use", a cluster node restarted
    on its port most of all)."""
    rng = random.Random()
    low, high = _ephemeral()
    spans = [(lo, hi) for lo, hi in ((10000, low - 10000), (high + 1, 55536)) if lo < hi]
    for _ in range(1000):
        lo, hi = rng.choice(spans) if spans else (20000, 45000)
        port = rng.randrange(lo, hi)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def self_signed(workdir: Path) -> tuple[str, str]:
    """A certificate and key for 127.0.0.1 (``openssl req``), for a TLS server."""
    cert, key = str(workdir / "cert.pem"), str(workdir / "key.pem")
    subprocess.run([binary("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install the redis-server package (scripts/dev.sh test does)")
    return path


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; ``args`` are extra config directives."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None, tls: tuple[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.tls = tls  # (certificate, key) files: TLS only, on self.port
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        ports = ["--port", str(self.port)]
        if self.tls:
            cert, key = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
        with open(self.dir / "log", "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [binary("redis-server"), *ports, "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no", *self.args],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:  # (interrupted or failed while it starts: nothing is left running)
            self.kill()
            raise
        return self

    def cli(self, *argv: str, password: str | None = None) -> str:
        cmd = [binary("redis-cli"), "-p", str(self.port), "--no-auth-warning"]
        if password:
            cmd += ["-a", password]
        return subprocess.run(cmd + list(argv), capture_output=True, text=True, timeout=30).stdout.strip()

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                    s = raw
                    if self.tls:
                        ctx = ssl.create_default_context(cafile=self.tls[0])
                        s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        """SIGKILL: the server is gone, as after a crash (its data too: no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RedisCluster:
    """Three masters (with ``replicas`` replicas each) on loopback ports, joined with
    ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes = [RedisServer(workdir, "--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                                  "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0")
                      for _ in range(3 * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> "RedisCluster":
        try:
            for n in self.nodes:
                n.args = (*n.args, "--cluster-config-file", str(n.dir / "nodes.conf"))
                n.start()
            out = subprocess.run([binary("redis-cli"), "--cluster", "create",
                                  *[f"127.0.0.1:{n.port}" for n in self.nodes], "--cluster-replicas",
                                  str(self.replicas), "--cluster-yes"], capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
            self.wait_ok()
        except BaseException:  # (interrupted or failed while it starts: no node is left running)
            for n in self.nodes:
                n.kill()
            raise
        return self

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.alive()):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def masters(self) -> list[RedisServer]:
        return [n for n in self.alive() if "role:master" in n.cli("info", "replication")]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
