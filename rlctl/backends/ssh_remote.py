"""The node agent on an SSH host: its remote files, and reading, uploading, starting and stopping it.

Role: the remote half of ``SshBackend.start_agent`` and ``release``, as shell and SFTP through one
host's ``SshConnections``. The config (it holds the job secret) is written 0600 over SFTP and never
appears in argv; the agent runs detached in its own session.
"""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from rlctl.backends.base import BackendError
from rlctl.backends.ssh_connections import SshConnections, SshHost, describe

RELEASE_GRACE_S = 5.0


@dataclass(frozen=True)
class RemotePaths:
    """Where the agent's files live on one host for one job."""

    root: str
    job_id: str

    @property
    def zipapp(self) -> str:
        return f"{self.root}/agent.pyz"

    @property
    def job_dir(self) -> str:
        return f"{self.root}/jobs/{self.job_id}"

    @property
    def config(self) -> str:
        return f"{self.job_dir}/agent.json"

    @property
    def pidfile(self) -> str:
        return f"{self.job_dir}/agent.pid"

    @property
    def logfile(self) -> str:
        return f"{self.job_dir}/agent.log"

    @property
    def workdir(self) -> str:
        return f"{self.job_dir}/work"


async def remote_state(ssh: SshConnections, host: SshHost, paths: RemotePaths) -> dict[str, str]:
    """sha256 of the remote zipapp/config and the running agent's pid (key ``alive``)."""
    q = shlex.quote
    cmd = (
        f"mkdir -p {q(paths.workdir)} && chmod 700 {q(paths.job_dir)} && "
        f"sha256sum {q(paths.zipapp)} {q(paths.config)} 2>/dev/null; "
        f"p=$(cat {q(paths.pidfile)} 2>/dev/null); "
        f'if [ -n "$p" ] && kill -0 "$p" 2>/dev/null && '
        f"tr '\\0' ' ' </proc/$p/cmdline | grep -qF -- {q('--config ' + paths.config)}; "
        f'then echo "alive $p"; fi; true'
    )
    out = await ssh.run(host, cmd, "reading the remote agent state")
    state: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "alive":
            state["alive"] = parts[1]
        elif len(parts) == 2:
            state[parts[1]] = parts[0]
    return state


async def upload(ssh: SshConnections, host: SshHost, paths: RemotePaths, zipapp: Path | None,
             config: bytes | None) -> None:
    """SFTP: zipapp and/or config to temp names, then atomic rename; the config is 0600 from creation."""
    conn = await ssh.conn(host)
    try:
        async with conn.start_sftp_client() as sftp:
            if zipapp is not None:
                tmp = f"{paths.zipapp}.tmp-{paths.job_id}"
                await asyncio.wait_for(sftp.put(str(zipapp), tmp), ssh.command_timeout_s)
                await sftp.posix_rename(tmp, paths.zipapp)
            if config is not None:
                tmp = f"{paths.config}.tmp"
                attrs = asyncssh.SFTPAttrs(permissions=0o600)
                async with sftp.open(tmp, "wb", attrs) as fh:
                    await fh.write(config)
                await sftp.chmod(tmp, 0o600)  # in case the server's umask widened it
                await sftp.posix_rename(tmp, paths.config)
    except (TimeoutError, OSError, asyncssh.Error) as exc:
        ssh.drop(host)
        raise BackendError(f"{host.name}: SFTP upload to {paths.root} failed: {describe(exc)}") from exc


async def spawn(ssh: SshConnections, host: SshHost, paths: RemotePaths, python: str) -> str:
    """Start the agent detached (own session, so its process group is its pid); returns the pid."""
    q = shlex.quote
    cmd = (
        f"cd {q(paths.job_dir)} || exit 2; "  # not `cd && cmd &`: that forks a subshell holding the channel
        f"setsid nohup {q(python)} {q(paths.zipapp)} --config {q(paths.config)} "
        f">{q(paths.logfile)} 2>&1 </dev/null & p=$!; echo $p >{q(paths.pidfile)}; "
        f'sleep 0.3; if kill -0 "$p" 2>/dev/null; then echo "pid $p"; '
        f'else echo "agent exited at once; log:"; tail -n 20 {q(paths.logfile)}; exit 3; fi'
    )
    out = await ssh.run(host, cmd, "starting the agent")
    return out.split()[1]


async def stop(ssh: SshConnections, host: SshHost, paths: RemotePaths, grace_s: float = RELEASE_GRACE_S,
           workers: bool = False) -> None:
    """SIGTERM the agent's process group, SIGKILL after ``grace_s``. With ``workers``, the job's
    role workers on this host go too: each runs in its own session (outside the agent's
    group) and outlives a killed agent, so they are found by the ``RLCTL_WORKDIR`` the agent
    put in their environment (this job, this node) and their process groups are signalled."""
    q = shlex.quote
    ticks = max(1, int(grace_s * 5))
    find_workers = (
        f"grep -lzxF -- {q('RLCTL_WORKDIR=' + paths.workdir)} /proc/[0-9]*/environ 2>/dev/null "
        "| cut -d/ -f3 | grep -vx $$" if workers else "true"
    )
    cmd = (
        f"p=$(cat {q(paths.pidfile)} 2>/dev/null); w=$({find_workers}); "
        f'[ -n "$p" ] && kill -0 "$p" 2>/dev/null || p=""; '
        f'for x in $p $w; do kill -TERM -- -"$x" 2>/dev/null || kill -TERM "$x" 2>/dev/null; done; '
        f'for i in $(seq {ticks}); do live=""; for x in $p $w; do kill -0 "$x" 2>/dev/null && live=1; done; '
        f'[ -z "$live" ] && break; sleep 0.2; done; '
        f'for x in $p $w; do kill -KILL -- -"$x" 2>/dev/null; kill -KILL "$x" 2>/dev/null; done; '
        f"rm -f {q(paths.pidfile)}; true"
    )
    await ssh.run(host, cmd, "stopping the agent and its workers", timeout_s=grace_s + ssh.command_timeout_s)
