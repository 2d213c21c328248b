"""Agent configuration: load and validate the 0600 JSON file the backend ships with the agent.

The file carries the per-job secret, so it is refused unless only its owner can read it. The
secret is kept as bytes inside ``AgentConfig`` and is left out of its ``repr`` so it cannot leak
into logs or tracebacks.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_PROVIDERS = ("auto", "nvml", "sim", "none")
# After a worker's NCCL watchdog line is read: time left for its flight-recorder dump before the agent
# kills it (rlctl_agent.watch). Read every 0.1 s, the worker is gone about 1.2 s after torch wrote it.
DEFAULT_NCCL_KILL_AFTER_S = 1.0
_MAX_CONFIG_BYTES = 1024 * 1024


class ConfigError(Exception):
    """The configuration file is missing, too open, malformed or incomplete."""


@dataclass(frozen=True)
class AgentConfig:
    """Validated agent settings. ``secret`` never appears in ``repr``."""

    job_id: str
    node: str
    controller_host: str
    controller_port: int
    workdir: Path
    gpu_provider: str = "auto"
    sim_gpus: int = 0
    heartbeat_interval_s: float = 1.0
    secret: bytes = field(default=b"", repr=False)
    tls_cert_pem: str = ""  # the controller's certificate, pinned; empty: plain TCP
    orphan_timeout_s: float = 1800.0  # no controller reachable this long: stop the workers, exit
    nccl_kill_after_s: float = DEFAULT_NCCL_KILL_AFTER_S  # a worker's NCCL watchdog fired this long ago: kill it

    @property
    def logs_dir(self) -> Path:
        """Where each worker's combined stdout/stderr goes (``<wid>.log``)."""
        return self.workdir / "logs"

    @property
    def state_path(self) -> Path:
        """The persisted worker table used to re-adopt workers after an agent restart."""
        return self.workdir / "agent-state.json"

    @property
    def socket_path(self) -> Path:
        """The unix socket that worker SDK clients connect to.

        ``workdir/agent.sock`` unless that path is longer than a unix socket address allows
        (108 bytes); then a short path in a private (0700) per-user directory under /tmp,
        named by a hash of the work directory.
        """
        return unix_socket_path(self.workdir / "agent.sock", self.workdir)


def unix_socket_path(preferred: Path, owner: Path, prefix: str = "") -> Path:
    """``preferred`` unless it is longer than a unix socket address allows (108 bytes); then a short
    path in a private (0700) per-user directory under /tmp, named by a hash of ``owner``."""
    if len(str(preferred).encode()) < 100:
        return preferred
    import hashlib

    private = Path(f"/tmp/rlctl-{os.getuid()}")
    private.mkdir(mode=0o700, exist_ok=True)
    os.chmod(private, 0o700)
    digest = hashlib.sha256(str(owner).encode()).hexdigest()[:20]
    return private / f"{prefix}{digest}.sock"


def check_private(path: Path) -> None:
    """Raise ConfigError unless ``path`` is a regular file readable by its owner only (0600 or stricter)."""
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read agent config {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"agent config {path} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"agent config {path} has mode {mode:04o}; it holds the job secret and must be 0600 or stricter "
            f"(chmod 600 {path})"
        )


def load_config(path: Path) -> AgentConfig:
    """Read, permission-check and validate the agent configuration at ``path``."""
    check_private(path)
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ConfigError(f"agent config {path} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"agent config {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"agent config {path} must hold a JSON object")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "<config>") -> AgentConfig:
    """Build an AgentConfig from a decoded JSON object, naming ``source`` in every error."""
    missing = [key for key in ("job_id", "node", "controller_host", "controller_port", "secret_hex", "workdir")
               if key not in raw]
    if missing:
        raise ConfigError(f"agent config {source} lacks {', '.join(missing)}")
    try:
        secret = bytes.fromhex(str(raw["secret_hex"]))
    except ValueError:
        raise ConfigError(f"agent config {source}: secret_hex is not hexadecimal") from None
    if len(secret) < 16:
        raise ConfigError(f"agent config {source}: the secret must be at least 16 bytes")
    provider = str(raw.get("gpu_provider", "auto"))
    if provider not in GPU_PROVIDERS:
        raise ConfigError(f"agent config {source}: gpu_provider {provider!r} is not one of {', '.join(GPU_PROVIDERS)}")
    try:
        port = int(raw["controller_port"])
        sim_gpus = int(raw.get("sim_gpus", 0))
        interval = float(raw.get("heartbeat_interval_s", 1.0))
        orphan_timeout = float(raw.get("orphan_timeout_s", 1800.0))
        nccl_kill_after = float(raw.get("nccl_kill_after_s", DEFAULT_NCCL_KILL_AFTER_S))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"agent config {source}: {exc}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"agent config {source}: controller_port {port} is out of range")
    if sim_gpus < 0 or interval <= 0:
        raise ConfigError(f"agent config {source}: sim_gpus must be >= 0 and heartbeat_interval_s > 0")
    if not orphan_timeout > 0:
        raise ConfigError(f"agent config {source}: orphan_timeout_s must be > 0")
    if not 0 <= nccl_kill_after <= 60:
        raise ConfigError(f"agent config {source}: nccl_kill_after_s must be in [0, 60], got {nccl_kill_after}")
    tls_cert_pem = str(raw.get("tls_cert_pem", ""))
    if tls_cert_pem:
        try:
            ssl.PEM_cert_to_DER_cert(tls_cert_pem)
        except ValueError:
            raise ConfigError(f"agent config {source}: tls_cert_pem is not a PEM certificate") from None
    return AgentConfig(
        job_id=str(raw["job_id"]),
        node=str(raw["node"]),
        controller_host=str(raw["controller_host"]),
        controller_port=port,
        workdir=Path(os.path.expanduser(str(raw["workdir"]))),
        gpu_provider=provider,
        sim_gpus=sim_gpus,
        heartbeat_interval_s=interval,
        secret=secret,
        tls_cert_pem=tls_cert_pem,
        orphan_timeout_s=orphan_timeout,
        nccl_kill_after_s=nccl_kill_after,
    )
