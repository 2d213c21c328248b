"""SSH connections to an inventory's hosts: one cached asyncssh connection per host, verified host
keys, bounded connects and commands, errors that name the host, the step and the key to check.

Role: what ``SshBackend`` runs every remote operation through (its agent deployment, probes and
releases live in ``rlctl.backends.ssh``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from rlctl.backends.base import BackendError


@dataclass(frozen=True)
class SshHost:
    """One inventory entry. ``spare`` hosts are handed out for spares and replacements first."""

    name: str
    address: str
    user: str = "root"
    port: int = 22
    key_file: Path | None = None
    spare: bool = False
    gpus: int = 0



class SshConnections:
    """Cached connections to the hosts, opened on first use and dropped after a failure."""

    def __init__(self, known_hosts: Path | None, key_file: Path | None, insecure: bool, connect_timeout_s: float,
                 command_timeout_s: float) -> None:
        self.known_hosts = known_hosts
        self.key_file = key_file
        self.insecure = insecure
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self._conns: dict[str, asyncssh.SSHClientConnection] = {}
        self._conn_locks: dict[str, asyncio.Lock] = {}

    def connect_kwargs(self, host: SshHost, connect_timeout_s: float) -> dict[str, Any]:
        key = host.key_file or self.key_file
        return {
            "host": host.address,
            "port": host.port,
            "username": host.user,
            "client_keys": [str(key)] if key else None,
            "known_hosts": None if self.insecure else str(self.known_hosts),
            "connect_timeout": connect_timeout_s,
            "keepalive_interval": 5,
            "keepalive_count_max": 3,
        }

    async def conn(self, host: SshHost) -> asyncssh.SSHClientConnection:
        lock = self._conn_locks.setdefault(host.name, asyncio.Lock())
        async with lock:
            conn = self._conns.get(host.name)
            if conn is not None and not conn.is_closed():
                return conn
            try:
                conn = await asyncssh.connect(**self.connect_kwargs(host, self.connect_timeout_s))
            except asyncssh.HostKeyNotVerifiable as exc:
                raise BackendError(f"{host.name} ({host.address}): host key not verified against "
                                   f"{self.known_hosts}: {exc} (add the host's key to the file that "
                                   f"[cluster.ssh] known_hosts names)") from exc
            except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as exc:
                raise BackendError(f"{host.name}: the private key {host.key_file or self.key_file} cannot be "
                                   f"used: {exc} (check [cluster.ssh] key_file)") from exc
            except (TimeoutError, OSError, asyncssh.Error) as exc:
                raise BackendError(f"{host.name} ({host.address}:{host.port}): ssh connect failed: "
                                   f"{describe(exc)} (check the host in [cluster.ssh] hosts, its sshd, "
                                   f"and [cluster.ssh] user/key_file)") from exc
            self._conns[host.name] = conn
            return conn

    def drop(self, host: SshHost) -> None:
        conn = self._conns.pop(host.name, None)
        if conn is not None:
            conn.abort()

    async def run(self, host: SshHost, command: str, what: str, timeout_s: float | None = None) -> str:
        """Run ``command`` on ``host``; returns stdout. Raises BackendError naming host and step."""
        timeout = timeout_s or self.command_timeout_s
        conn = await self.conn(host)
        try:
            result = await asyncio.wait_for(conn.run(command, check=False), timeout)
        except (TimeoutError, OSError, asyncssh.Error) as exc:
            self.drop(host)
            raise BackendError(f"{host.name}: {what} failed: {describe(exc)} (timeout {timeout:.0f}s)") from exc
        if result.exit_status != 0:
            err = str(result.stderr or result.stdout or "").strip()[-500:]
            raise BackendError(f"{host.name}: {what} exited {result.exit_status}: {err}")
        return str(result.stdout or "")

    async def close(self) -> None:
        """Close every cached connection (waiting up to 5 s each)."""
        conns = list(self._conns.values())
        self._conns.clear()
        for conn in conns:
            conn.close()
        for conn in conns:
            try:
                await asyncio.wait_for(conn.wait_closed(), 5)
            except (TimeoutError, OSError, asyncssh.Error):
                pass


def describe(exc: BaseException) -> str:
    """An exception as the one line an error message quotes."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
