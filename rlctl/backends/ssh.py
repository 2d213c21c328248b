"""SSH backend: a static inventory of machines reached with asyncssh.

Contract (see ``rlctl.backends.base.Backend``):

* Host keys are always verified against a ``known_hosts`` file. ``insecure_no_host_key_check``
  turns that off, logs a loud warning, and is meant for tests only.
* Every remote operation goes through one semaphore (``max_parallel``) and has a connect and
  a command timeout, so one dead host never stalls the others.
* ``start_agent`` uploads the agent zipapp over SFTP only when the remote ``sha256sum``
  differs, writes the agent config (it holds the job secret) 0600 over SFTP (never in argv),
  and starts the agent detached with ``setsid nohup``; it is idempotent (an agent already
  running with the same zipapp and config is left alone).
* ``probe`` opens a fresh connection and runs ``true`` with a short timeout: the detector's
  second path, independent of the agent's heartbeats.
* Which inventory host serves which role is persisted in ``<job_dir>/backend-ssh.json`` so a
  restarted controller can ``adopt`` its nodes.
* ``release`` stops the agent *and* the job's role workers on the host (workers run in their own
  sessions, outside the agent's process group). A host that cannot be reached then (partitioned,
  dead) is remembered in the state file and retried by every later ``release``, including the
  one at the end of the job, so a node that comes back is cleaned up.
* ``inject`` carries out backend-level faults through the fault injector it was given (for a lab
  job ``rlctl.assembly`` gives the lab's: ``partition``, ``node-down``, ``slow-link``;
  ``supported_faults`` says which).

Remote layout per host (``remote_dir`` may contain ``{node}``, needed when hosts share a
filesystem, as lab nodes do)::

    <remote_dir>/agent.pyz                      shared by jobs, replaced only when its hash changes
    <remote_dir>/jobs/<job_id>/agent.json       0600, the secret
    <remote_dir>/jobs/<job_id>/agent.pid|.log   the detached agent
    <remote_dir>/jobs/<job_id>/work/            the agent's workdir
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import shlex
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from rlctl.backends.base import (
    AgentLaunch,
    AllocationRequest,
    BackendError,
    FaultInjector,
    NodeInfo,
    ProbeResult,
)
from rlctl.backends.ssh_connections import SshConnections, SshHost, describe
from rlctl.backends.ssh_remote import RELEASE_GRACE_S, RemotePaths, remote_state, spawn, stop, upload

log = logging.getLogger(__name__)

STATE_FILE = "backend-ssh.json"
SPARE_ROLE = "spare"


@dataclass(frozen=True)
class DeployOutcome:
    """What the last ``start_agent`` did on one host (the tests and the bench read it)."""

    uploaded_zipapp: bool
    wrote_config: bool
    started: bool
    pid: int | None
    seconds: float


def parse_host_entry(entry: str, *, user: str, port: int, spare: bool = False,
                     key_file: Path | None = None) -> SshHost:
    """Parse a job.toml inventory entry ``name=address`` where address is ``[user@]host[:port]``."""
    name, sep, address = entry.partition("=")
    if not sep or not name.strip() or not address.strip():
        raise BackendError(f"ssh inventory entry {entry!r}: expected 'name=[user@]host[:port]'")
    address = address.strip()
    if "@" in address:
        user, address = address.split("@", 1)
    if address.count(":") == 1:
        address, port_text = address.split(":")
        if not port_text.isdigit():
            raise BackendError(f"ssh inventory entry {entry!r}: port {port_text!r} is not a number")
        port = int(port_text)
    return SshHost(name=name.strip(), address=address, user=user, port=port, key_file=key_file, spare=spare)


class SshBackend:
    """Backend over a static SSH inventory (see the module docstring for the contract)."""

    name = "ssh"
    on_this_machine = False

    def __init__(
        self,
        hosts: list[SshHost],
        *,
        known_hosts: Path | None,
        job_dir: Path,
        key_file: Path | None = None,
        remote_dir: str = "/tmp/rlctl/{node}",
        python: str = "python3",
        max_parallel: int = 32,
        connect_timeout_s: float = 10.0,
        command_timeout_s: float = 60.0,
        probe_timeout_s: float = 5.0,
        insecure_no_host_key_check: bool = False,
        fault_injector: FaultInjector | None = None,
        release_timeout_s: float | None = None,
    ) -> None:
        names = [h.name for h in hosts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise BackendError(f"ssh inventory has duplicate host names: {', '.join(dupes)}")
        if known_hosts is None and not insecure_no_host_key_check:
            raise BackendError("ssh backend needs a known_hosts file (host keys are always verified)")
        if insecure_no_host_key_check:
            log.warning("!!! SSH HOST KEY VERIFICATION IS DISABLED (insecure_no_host_key_check=True). "
                        "Anyone on the network can impersonate these hosts. Use this only in tests. !!!")
        self.hosts: dict[str, SshHost] = {h.name: h for h in hosts}
        self.ssh = SshConnections(known_hosts, key_file, insecure_no_host_key_check, connect_timeout_s,
                                  command_timeout_s)
        self.job_dir = Path(job_dir)
        self.remote_dir = remote_dir
        self.python = python
        self.command_timeout_s = command_timeout_s
        self.probe_timeout_s = probe_timeout_s
        # one host's release (connect + stop), bounded so a dead host never stalls the others and
        # below the 15 s the controller gives the release of a failed node
        self.release_timeout_s = release_timeout_s or min(connect_timeout_s, 5.0) + RELEASE_GRACE_S + 2.0
        self.last_deploy: dict[str, DeployOutcome] = {}
        self._sem = asyncio.Semaphore(max_parallel)
        self._assigned: dict[str, str] = {}
        self._unreleased: dict[str, str] = {}  # host name -> job id ("" = every job dir found)
        self._job_id = ""  # the job these hosts serve (from allocate/start_agent), persisted
        self._load_state()
        self._faults = fault_injector

    @property
    def supported_faults(self) -> frozenset[str]:
        """Backend-level faults ``inject`` can carry out (the controller's API checks this)."""
        return self._faults.supported_faults if self._faults is not None else frozenset()

    # --- construction from job.toml --------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict[str, Any], job_dir: Path,
                    fault_injector: FaultInjector | None = None) -> SshBackend:
        """Build from the ``[cluster.ssh]`` table (keys: see docs/backends.md)."""
        hosts = inventory_from_config(cfg)
        key = cfg.get("key_file") or cfg.get("key")
        key_path = Path(str(key)).expanduser() if key else None
        known = cfg.get("known_hosts", "~/.ssh/known_hosts")
        return cls(
            hosts,
            known_hosts=Path(str(known)).expanduser() if known else None,
            job_dir=job_dir,
            key_file=key_path,
            remote_dir=str(cfg.get("remote_dir", "/tmp/rlctl/{node}")),
            python=str(cfg.get("python", "python3")),
            max_parallel=int(cfg.get("max_parallel", 32)),
            connect_timeout_s=float(cfg.get("connect_timeout_s", 10.0)),
            command_timeout_s=float(cfg.get("command_timeout_s", 60.0)),
            probe_timeout_s=float(cfg.get("probe_timeout_s", 5.0)),
            insecure_no_host_key_check=bool(cfg.get("insecure_no_host_key_check", False)),
            fault_injector=fault_injector,
            release_timeout_s=float(cfg["release_timeout_s"]) if cfg.get("release_timeout_s") else None,
        )

    # --- persisted assignment ----------------------------------------------------------------
    def _state_path(self) -> Path:
        return self.job_dir / STATE_FILE

    def _load_state(self) -> None:
        try:
            data = json.loads(self._state_path().read_text())
        except (OSError, ValueError):
            return
        self._assigned = {str(k): str(v) for k, v in data.get("assigned", {}).items()}
        self._unreleased = {str(k): str(v) for k, v in data.get("unreleased", {}).items()}
        self._job_id = str(data.get("job_id", ""))

    def _save_state(self) -> None:
        self.job_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path().with_suffix(".tmp")
        state = {"assigned": self._assigned, "unreleased": self._unreleased, "job_id": self._job_id}
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
        tmp.replace(self._state_path())

    def _node(self, host: SshHost, role: str) -> NodeInfo:
        return NodeInfo(name=host.name, host=host.address, backend_ref=host.name, gpus=host.gpus,
                        extra={"role": role, "spare": role == SPARE_ROLE})

    def _host(self, node: NodeInfo) -> SshHost:
        try:
            return self.hosts[node.backend_ref or node.name]
        except KeyError:
            raise BackendError(f"{node.name} is not in the ssh inventory") from None

    # --- plan / allocate ---------------------------------------------------------------------
    def _pick(self, request: AllocationRequest) -> list[tuple[SshHost, str]]:
        return pick_hosts(list(self.hosts.values()), frozenset(self._assigned), request)

    def plan_text(self, request: AllocationRequest) -> str:
        """Which inventory host gets which role. No side effects."""
        return ssh_plan_text(list(self.hosts.values()), frozenset(self._assigned), request)

    async def allocate(self, request: AllocationRequest) -> list[NodeInfo]:
        """Assign inventory hosts to roles and spares (nothing remote happens). Call once per job."""
        picks = self._pick(request)
        for host, role in picks:
            self._assigned[host.name] = role
        self._job_id = request.job_id
        self._save_state()
        return [self._node(host, role) for host, role in picks]

    async def adopt(self, nodes: list[NodeInfo]) -> None:
        """Mark ``nodes`` as this job's again (after a controller restart)."""
        for node in nodes:
            self._assigned[self._host(node).name] = str(node.extra.get("role", SPARE_ROLE))
        self._save_state()

    async def replace(self, bad: NodeInfo, exclude: frozenset[str]) -> NodeInfo | None:
        """Next unused host (spare-marked first), never ``bad`` or one in ``exclude``."""
        role = str(bad.extra.get("role", SPARE_ROLE))
        free = [h for h in self.hosts.values()
                if h.name not in self._assigned and h.name not in exclude and h.name != bad.name]
        free.sort(key=lambda h: not h.spare)  # spare-marked hosts first, inventory order kept
        if not free:
            return None
        host = free[0]
        self._assigned[host.name] = role
        self._save_state()
        return self._node(host, role)

    async def run_command(self, node: NodeInfo, command: str, timeout_s: float | None = None) -> str:
        """Run a shell command on ``node`` (bounded, timed out); stdout. For tools and tests."""
        host = self._host(node)
        async with self._sem:
            return await self.ssh.run(host, command, f"`{command[:60]}`", timeout_s)

    # --- agent -------------------------------------------------------------------------------
    def paths(self, node: NodeInfo, job_id: str) -> RemotePaths:
        """Remote paths; ``remote_dir`` without ``{node}`` gets ``/<node>`` appended (shared-FS safe)."""
        root = self.remote_dir if "{node}" in self.remote_dir else self.remote_dir.rstrip("/") + "/{node}"
        return RemotePaths(root=root.format(node=node.name).rstrip("/"), job_id=job_id)

    def agent_config(self, node: NodeInfo, launch: AgentLaunch) -> bytes:
        """The agent's JSON config for ``node`` (holds the secret; shipped 0600 only)."""
        cfg = launch.agent_config(node.name, self.paths(node, launch.job_id).workdir)
        return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()

    async def start_agent(self, node: NodeInfo, launch: AgentLaunch) -> None:
        """Ship the zipapp (if its hash differs) and the 0600 config, start the agent. Idempotent."""
        host = self._host(node)
        t0 = time.perf_counter()
        paths = self.paths(node, launch.job_id)
        config = self.agent_config(node, launch)
        config_sha = hashlib.sha256(config).hexdigest()
        async with self._sem:
            remote = await remote_state(self.ssh, host, paths)
            need_zip = remote.get(paths.zipapp) != launch.agent_zipapp_sha256
            need_cfg = remote.get(paths.config) != config_sha
            if need_zip or need_cfg:
                await upload(self.ssh, host, paths, launch.agent_zipapp if need_zip else None,
                             config if need_cfg else None)
            pid = remote.get("alive")
            started = False
            if pid is None or need_zip or need_cfg:
                if pid is not None:
                    await stop(self.ssh, host, paths)
                pid = await spawn(self.ssh, host, paths, self.python)
                started = True
        self.last_deploy[node.name] = DeployOutcome(need_zip, need_cfg, started, int(pid) if pid else None,
                                                    time.perf_counter() - t0)
        log.info("agent on %s: zipapp %s, config %s, %s (pid %s)", node.name,
                 "uploaded" if need_zip else "unchanged", "written" if need_cfg else "unchanged",
                 "started" if started else "already running", pid)

    # --- probe / release / inject ------------------------------------------------------------
    async def probe(self, node: NodeInfo) -> ProbeResult:
        """Fresh SSH connection + ``true`` within ``probe_timeout_s``. Never raises."""
        try:
            host = self._host(node)
        except BackendError as exc:
            return ProbeResult(False, str(exc))
        t0 = time.perf_counter()
        try:
            async with self._sem, asyncssh.connect(**self.ssh.connect_kwargs(host, self.probe_timeout_s)) as conn:
                result = await asyncio.wait_for(conn.run("true", check=False), self.probe_timeout_s)
        except asyncssh.HostKeyNotVerifiable as exc:
            return ProbeResult(False, f"{host.name}: host key not verified: {exc}")
        except (TimeoutError, OSError, asyncssh.Error) as exc:
            return ProbeResult(False, f"{host.name} ({host.address}:{host.port}): ssh probe failed after "
                                      f"{time.perf_counter() - t0:.1f}s: {describe(exc)}")
        if result.exit_status != 0:
            return ProbeResult(False, f"{host.name}: `true` exited {result.exit_status}")
        return ProbeResult(True, f"{host.name}: ssh ok in {time.perf_counter() - t0:.2f}s")

    async def release(self, nodes: list[NodeInfo], *, clean: bool = False, job_id: str | None = None) -> None:
        """Stop the agents (by pidfile) and the job's workers, optionally delete their job dirs,
        give the hosts back.

        Idempotent; each host is bounded by ``release_timeout_s``. A host that cannot be reached
        is logged, still given back, and remembered: every later ``release`` tries it again (the
        job's last release cleans a partitioned node that came back). ``job_id`` defaults to
        the job this backend allocated for, else every job dir under ``remote_dir``.
        """
        job_id = job_id or self._job_id or None
        targets = {self._host(n).name: (n, job_id) for n in nodes}
        for name, pending_job in self._unreleased.items():
            if name not in targets and name in self.hosts:
                targets[name] = (self._node(self.hosts[name], SPARE_ROLE), pending_job or None)
        for name, (_, jid) in targets.items():  # written before the attempt: a cancelled release is retried too
            self._unreleased.setdefault(name, jid or "")
            self._assigned.pop(name, None)
        self._save_state()
        results = await asyncio.gather(*(self._release_bounded(n, clean, jid) for n, jid in targets.values()),
                                       return_exceptions=True)
        for name, result in zip(targets, results):
            if isinstance(result, BaseException):
                log.warning("release %s: %s (retried by the next release)", name, result)
            else:
                self._unreleased.pop(name, None)
        self._save_state()

    async def _release_bounded(self, node: NodeInfo, clean: bool, job_id: str | None) -> None:
        host = self._host(node)
        if not await self._port_open(host):  # a dead or cut-off host: do not wait out the SSH timeouts
            self.ssh.drop(host)
            raise BackendError(f"{host.name} ({host.address}:{host.port}): not reachable within "
                               f"{self.probe_timeout_s:.0f}s")
        try:
            await asyncio.wait_for(self._release_one(node, clean, job_id), self.release_timeout_s)
        except TimeoutError:
            self.ssh.drop(host)  # a cached connection to a host that went silent is useless now
            raise BackendError(f"{host.name} ({host.address}): release timed out after "
                               f"{self.release_timeout_s:.0f}s") from None

    async def _port_open(self, host: SshHost) -> bool:
        """A TCP connect to the host's SSH port within ``probe_timeout_s`` (no SSH handshake)."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.address, host.port), self.probe_timeout_s)
        except (TimeoutError, OSError):
            return False
        writer.close()
        return True

    async def _release_one(self, node: NodeInfo, clean: bool, job_id: str | None) -> None:
        host = self._host(node)
        job_ids = [job_id] if job_id else await self._job_ids(host, node)
        async with self._sem:
            for jid in job_ids:
                paths = self.paths(node, jid)
                await stop(self.ssh, host, paths, workers=True)
                if clean:
                    await self.ssh.run(host, f"rm -rf {shlex.quote(paths.job_dir)}", "removing the job dir")

    async def _job_ids(self, host: SshHost, node: NodeInfo) -> list[str]:
        root = shlex.quote(self.paths(node, "_").root)
        async with self._sem:
            out = await self.ssh.run(host, f"ls {root}/jobs 2>/dev/null; true", "listing job dirs")
        return [j for j in out.split() if j]

    async def inject(self, node: NodeInfo, kind: str, params: dict[str, Any]) -> bool:
        """Backend-level faults through the injector given at construction (the lab's:
        ``partition``, ``node-down``, ``slow-link`` with ``delay_ms``; ``duration`` undoes any of them).
        False (unsupported) otherwise."""
        if self._faults is None:
            return False
        return await self._faults.inject(self._host(node).name, kind, params)

    async def close(self) -> None:
        """Close every cached SSH connection. Nodes and agents are left as they are."""
        if self._faults is not None:
            await self._faults.close()
        await self.ssh.close()


def hosts_from_lab(names_and_ips: Iterable[tuple[str, str]], spares: Iterable[str] = (),
                   user: str = "rlctl-lab") -> list[SshHost]:
    """Inventory for lab nodes (the lab's login user, port 22) with ``spares`` marked."""
    spare_set = set(spares)
    return [SshHost(name=n, address=ip, user=user, spare=n in spare_set) for n, ip in names_and_ips]


def inventory_from_config(cfg: dict[str, Any]) -> list[SshHost]:
    """The hosts of a ``[cluster.ssh]`` table, spares marked. Pure."""
    user = str(cfg.get("user", "root"))
    port = int(cfg.get("port", 22))
    spares = set(cfg.get("spares", []))
    key = cfg.get("key_file") or cfg.get("key")
    key_path = Path(str(key)).expanduser() if key else None
    hosts = [parse_host_entry(e, user=user, port=port, key_file=key_path, spare=False) for e in cfg.get("hosts", [])]
    unknown = spares - {h.name for h in hosts}
    if unknown:
        raise BackendError(f"cluster.ssh.spares names hosts not in the inventory: {', '.join(sorted(unknown))}")
    return [dataclasses.replace(h, spare=h.name in spares) for h in hosts]


def pick_hosts(hosts: list[SshHost], assigned: frozenset[str], request: AllocationRequest) -> list[tuple[SshHost, str]]:
    """Which free host takes which role, spares last (spare-marked hosts first for them). Pure."""
    free = [h for h in hosts if h.name not in request.exclude and h.name not in assigned]
    regular = [h for h in free if not h.spare]
    spare = [h for h in free if h.spare]
    picks: list[tuple[SshHost, str]] = []
    for role, count in request.nodes_by_role.items():
        if len(regular) < count:
            raise BackendError(f"ssh inventory: role {role!r} needs {count} hosts, "
                               f"{len(regular)} non-spare hosts left (inventory {len(hosts)})")
        picks += [(regular.pop(0), role) for _ in range(count)]
    pool = spare + regular
    if len(pool) < request.spares:
        raise BackendError(f"ssh inventory: {request.spares} spares wanted, {len(pool)} hosts left")
    picks += [(pool.pop(0), SPARE_ROLE) for _ in range(request.spares)]
    return picks


def ssh_plan_text(hosts: list[SshHost], assigned: frozenset[str], request: AllocationRequest) -> str:
    """Which inventory host gets which role, as ``launch --dry-run`` shows it. Pure."""
    lines = [f"# ssh backend plan for job {request.job_id}"]
    try:
        picks = pick_hosts(hosts, assigned, request)
    except BackendError as exc:
        return "\n".join([*lines, f"# cannot place the job: {exc}"]) + "\n"
    for host, role in picks:
        lines.append(f"{role:<8} {host.name:<12} {host.user}@{host.address}:{host.port}")
    unused = [h for h in hosts if h.name not in {p[0].name for p in picks}]
    lines += [f"{'(free)':<8} {h.name:<12} {'spare-marked' if h.spare else ''}".rstrip() for h in unused]
    return "\n".join(lines) + "\n"
