"""Slurm backend: one job array per role (one single-node allocation per array task) via sbatch/srun.

Design (docs/backends.md has the reasoning): each role (and the spares) is submitted as one
``sbatch --array=0-(n-1)`` with ``--nodes=1 --exclusive --no-requeue``; each array task holds one
node and runs ``srun --ntasks-per-node=1 bash <task script>``, which starts the agent with the
0600 config the controller writes to the (shared) job dir once it knows the node. A node
failure ends only that node's task (NODE_FAIL); nothing else is touched. A replacement is one
more single-task array with ``--exclude=<bad nodes>`` (or ``--nodelist=<node>``).

State comes from ``squeue --json`` and ``scontrol show node|job -o`` (no sacct/slurmdbd), and
is translated by :mod:`rlctl.backends.slurm_states` so that NODE_FAIL/PREEMPTED/TIMEOUT and a
DOWN/DRAIN node never look like an application failure. ``probe`` adds a direct TCP connect to
the node's slurmd: slurmctld itself notices a dead node only after ``SlurmdTimeout`` (300 s by
default), far too late to confirm a silent agent. Submitted job ids are persisted in
``<job_dir>/slurm/state.json`` for ``adopt`` after a controller restart.

Assumes the job dir is on a filesystem shared by this machine and the nodes (true in the lab
and on most Slurm clusters: $HOME or a parallel FS).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rlctl.backends.base import AgentLaunch, AllocationRequest, BackendError, FaultInjector, NodeInfo, ProbeResult
from rlctl.backends.slurm_commands import (
    SlurmCommands,
    SlurmTask,
)
from rlctl.backends.slurm_scripts import SPARE_ROLE, SbatchScripts
from rlctl.backends.slurm_states import JobOutcome, map_job_state, map_node_state

log = logging.getLogger(__name__)

POLL_S = 0.5


class SlurmBackend:
    """Backend over sbatch/srun/squeue/scontrol on this machine (see the module docstring)."""

    name = "slurm"
    on_this_machine = False

    def __init__(
        self,
        *,
        job_dir: Path,
        partition: str = "",
        account: str = "",
        time_limit: str = "",
        python: str = "python3",
        node_workdir: str = "/tmp/rlctl/{job_id}/{node}",
        exclude: frozenset[str] = frozenset(),
        allow_drain: bool = False,
        extra_sbatch: tuple[str, ...] = (),
        slurm_conf: Path | None = None,
        allocate_timeout_s: float = 120.0,
        replace_timeout_s: float = 60.0,
        agent_start_timeout_s: float = 30.0,
        command_timeout_s: float = 30.0,
        template_dir: Path | None = None,
        fault_injector: FaultInjector | None = None,
        probe_timeout_s: float = 2.0,
    ) -> None:
        self.job_dir = Path(job_dir)
        self.slurm_dir = self.job_dir / "slurm"
        self.partition = partition
        self.python = python
        self.node_workdir = node_workdir
        self.allow_drain = allow_drain
        self.commands = SlurmCommands(slurm_conf, command_timeout_s)
        self.allocate_timeout_s = allocate_timeout_s
        self.replace_timeout_s = replace_timeout_s
        self.agent_start_timeout_s = agent_start_timeout_s
        self.command_timeout_s = command_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._faults = fault_injector
        self.scripts = SbatchScripts(self.slurm_dir, partition, account, time_limit, python, frozenset(exclude),
                                     tuple(extra_sbatch), template_dir)
        self._state: dict[str, Any] = self._load_state()

    @classmethod
    def from_config(cls, cfg: dict[str, Any], job_dir: Path,
                    fault_injector: FaultInjector | None = None) -> SlurmBackend:
        """Build from the ``[cluster.slurm]`` table (keys: see docs/backends.md)."""
        conf = cfg.get("slurm_conf")
        return cls(
            job_dir=job_dir,
            **script_settings(cfg),
            node_workdir=str(cfg.get("node_workdir") or "/tmp/rlctl/{job_id}/{node}"),
            allow_drain=bool(cfg.get("allow_drain", False)),
            slurm_conf=Path(str(conf)) if conf else None,
            allocate_timeout_s=float(cfg.get("allocate_timeout_s", 120.0)),
            replace_timeout_s=float(cfg.get("replace_timeout_s", 60.0)),
            agent_start_timeout_s=float(cfg.get("agent_start_timeout_s", 30.0)),
            fault_injector=fault_injector,
            probe_timeout_s=float(cfg.get("probe_timeout_s", 2.0)),
        )

    @property
    def supported_faults(self) -> frozenset[str]:
        """Backend-level faults ``inject`` can carry out (the controller's API checks this)."""
        return self._faults.supported_faults if self._faults is not None else frozenset()

    # --- persisted state ---------------------------------------------------------------------
    def _state_path(self) -> Path:
        return self.slurm_dir / "state.json"

    def _load_state(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self._state_path().read_text()))
        except (OSError, ValueError):
            return {"arrays": []}

    def _save_state(self) -> None:
        self.slurm_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state, indent=2, sort_keys=True))
        tmp.replace(self._state_path())

    # --- rendering (pure) --------------------------------------------------------------------
    def plan_text(self, request: AllocationRequest) -> str:
        """Every sbatch script ``allocate`` would submit, plus the task script. No side effects."""
        return self.scripts.plan_text(request)

    # --- allocation --------------------------------------------------------------------------
    def _prepare_dirs(self, job_id: str) -> None:
        for sub in ("", "agents", "log"):
            (self.slurm_dir / sub).mkdir(parents=True, exist_ok=True)
        (self.slurm_dir / "agents").chmod(0o700)
        self.scripts.task_script.write_text(self.scripts.render_task_script(job_id))
        self.scripts.task_script.chmod(0o755)

    async def _submit(self, job_id: str, role: str, count: int, gpus: int, *,
                      exclude: frozenset[str] = frozenset(), nodelist: tuple[str, ...] = ()) -> str:
        """Write and sbatch one role script; returns the array job id."""
        script = self.scripts.render_role_script(job_id, role, count, gpus, exclude=exclude, nodelist=nodelist)
        n = len(self._state["arrays"])
        path = self.slurm_dir / f"{role}-{n}.sbatch"
        path.write_text(script)
        try:
            out = await self.commands.run("sbatch", "--parsable", str(path))
        except BackendError as exc:
            if "node configuration is not available" not in str(exc):
                raise
            raise BackendError(f"{exc} (role {role} asks for {count} node(s) with {gpus} GPU(s) each"
                               f"{' in partition ' + self.partition if self.partition else ''}; "
                               f"is [roles.{role}] gpus_per_node more than the nodes' Gres=gpu:N?)") from None
        array_id = out.strip().split(";")[0]
        if not array_id.isdigit():
            raise BackendError(f"sbatch {path} printed {out.strip()!r}, expected a job id")
        self._state["arrays"].append({"array_job_id": array_id, "role": role, "count": count, "script": str(path)})
        self._save_state()
        log.info("submitted %s: %d node(s) for role %s as array job %s", path.name, count, role, array_id)
        return array_id

    async def _wait_running(self, arrays: dict[str, tuple[str, int]], timeout_s: float) -> list[SlurmTask]:
        """Wait until every task of ``arrays`` ({array id: (role, count)}) runs; raise/None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            tasks = [t for t in await self.commands.squeue() if t.array_job_id in arrays]
            running = [t for t in tasks if map_job_state(t.state).outcome is JobOutcome.RUNNING and t.nodes]
            dead = [t for t in tasks if map_job_state(t.state).terminal]
            if dead:
                raise BackendError("allocation ended before it ran: " + ", ".join(
                    f"job {t.job_id} ({t.name}) {t.state} {t.reason}" for t in dead))
            if len(running) == sum(c for _, c in arrays.values()):
                return running
            if time.monotonic() > deadline:
                pending = [f"{t.name} {t.job_id}: {t.state} ({t.reason})" for t in tasks if t not in running]
                raise TimeoutError(f"allocation not running after {timeout_s:.0f}s: {'; '.join(pending)}")
            await asyncio.sleep(POLL_S)

    async def _node_info(self, task: SlurmTask, role: str, gpus: int) -> NodeInfo:
        rec = await self.commands.show_node(task.nodes)
        return NodeInfo(
            name=task.nodes, host=rec.get("NodeAddr", task.nodes), backend_ref=task.job_id, gpus=gpus,
            extra={"role": role, "spare": role == SPARE_ROLE, "array_job_id": task.array_job_id,
                   "array_task_id": task.array_task_id},
        )

    async def allocate(self, request: AllocationRequest) -> list[NodeInfo]:
        """Submit one array per role (+ spares) and wait until every task runs. Call once per job."""
        self._state.update({"job_id": request.job_id, "arrays": self._state.get("arrays", [])})
        self._prepare_dirs(request.job_id)
        arrays: dict[str, tuple[str, int]] = {}
        gpus_of: dict[str, int] = {}
        for role, count, gpus in self.scripts.role_counts(request):
            arrays[await self._submit(request.job_id, role, count, gpus, exclude=request.exclude)] = (role, count)
            gpus_of[role] = gpus
        try:
            running = await self._wait_running(arrays, self.allocate_timeout_s)
        except (TimeoutError, BackendError) as exc:
            await self.commands.scancel(list(arrays))
            raise BackendError(f"allocate for job {request.job_id}: {exc}; cancelled the submitted arrays") from exc
        running.sort(key=lambda t: (list(arrays).index(t.array_job_id), t.array_task_id or 0))
        nodes = [await self._node_info(t, arrays[t.array_job_id][0], gpus_of[arrays[t.array_job_id][0]])
                 for t in running]
        self._state["nodes"] = {n.name: n.backend_ref for n in nodes}
        self._save_state()
        return nodes

    async def adopt(self, nodes: list[NodeInfo]) -> None:
        """Check that the adopted nodes' allocations still exist; they keep running as they are."""
        known = {t.job_id: t for t in await self.commands.squeue()}
        gone = [f"{n.name} (job {n.backend_ref})" for n in nodes if n.backend_ref not in known]
        if gone:
            log.warning("adopt: allocations no longer in squeue: %s", ", ".join(gone))

    async def replace(self, bad: NodeInfo, exclude: frozenset[str]) -> NodeInfo | None:
        """A new single-node allocation for ``bad``'s role with ``--exclude``; None if none in time.

        Cancels ``bad``'s own allocation (if still there) and drains ``bad`` when ``allow_drain``.
        """
        role = str(bad.extra.get("role", SPARE_ROLE))
        if self.allow_drain:
            await self.drain(bad.name, f"rlctl: replaced in job {self._state.get('job_id', '?')}")
        if bad.backend_ref:
            await self.commands.scancel([bad.backend_ref])
        array_id = await self._submit(str(self._state.get("job_id", "job")), role, 1, bad.gpus,
                                      exclude=frozenset(exclude) | {bad.name})
        try:
            running = await self._wait_running({array_id: (role, 1)}, self.replace_timeout_s)
        except (TimeoutError, BackendError) as exc:
            log.warning("replace %s: %s; cancelling array %s", bad.name, exc, array_id)
            await self.commands.scancel([array_id])
            return None
        node = await self._node_info(running[0], role, bad.gpus)
        self._state.setdefault("nodes", {})[node.name] = node.backend_ref
        self._save_state()
        return node

    async def drain(self, node: str, reason: str) -> None:
        """``scontrol update nodename=X state=drain reason=...`` (needs operator rights)."""
        await self.commands.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    # --- agent -------------------------------------------------------------------------------
    def config_path(self, node: NodeInfo) -> Path:
        return self.slurm_dir / "agents" / f"{node.name}-{node.backend_ref}.json"

    def status_path(self, node: NodeInfo) -> Path:
        return self.slurm_dir / "agents" / f"{node.name}-{node.backend_ref}.status"

    def agent_config(self, node: NodeInfo, launch: AgentLaunch) -> bytes:
        cfg = launch.agent_config(
            node.name, self.node_workdir.format(job_id=launch.job_id, node=node.name, job_dir=self.job_dir))
        return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()

    def _ship_zipapp(self, launch: AgentLaunch) -> bool:
        """Copy the zipapp into the shared job dir unless the same bytes are there. True if copied."""
        if self.scripts.zipapp_path.exists() and _sha256(self.scripts.zipapp_path) == launch.agent_zipapp_sha256:
            return False
        tmp = self.scripts.zipapp_path.with_suffix(".tmp")
        shutil.copyfile(launch.agent_zipapp, tmp)
        tmp.replace(self.scripts.zipapp_path)
        return True

    def _read_status(self, node: NodeInfo) -> list[str]:
        try:
            return self.status_path(node).read_text().split()
        except OSError:
            return []

    async def start_agent(self, node: NodeInfo, launch: AgentLaunch) -> None:
        """Write the node's 0600 config (new file => the task starts/restarts the agent) and wait
        until the task reports the agent running with it. Idempotent."""
        self._ship_zipapp(launch)
        path = self.config_path(node)
        config = self.agent_config(node, launch)
        status = self._read_status(node)
        current = path.exists() and path.read_bytes() == config
        if current and status[:1] == ["running"] and status[2:3] == [str(path.stat().st_ino)]:
            return
        _write_private(path, config)
        await self._wait_agent(node, str(path.stat().st_ino))

    async def _wait_agent(self, node: NodeInfo, gen: str) -> None:
        deadline = time.monotonic() + self.agent_start_timeout_s
        while time.monotonic() < deadline:
            status = self._read_status(node)
            if status[:1] == ["running"] and status[2:3] == [gen]:
                return
            if status[:1] == ["exited"] and status[2:3] == [gen]:
                raise BackendError(f"{node.name} (job {node.backend_ref}): agent exited with {status[1]}; "
                                   f"log {self.slurm_dir}/agents/{node.name}-{node.backend_ref}.log")
            await asyncio.sleep(0.1)
        verdict = await self.commands.job_verdict(node.backend_ref)
        raise BackendError(f"{node.name} (job {node.backend_ref}): agent not started within "
                           f"{self.agent_start_timeout_s:.0f}s (task status {self._read_status(node) or 'none'}, "
                           f"job {verdict.outcome}/{verdict.reason})")

    # --- probe / release / inject ------------------------------------------------------------
    async def probe(self, node: NodeInfo) -> ProbeResult:
        """Two views, at once: Slurm's (node DOWN/not responding or the allocation ended =>
        unreachable) and the network's (a TCP connect to the node's slurmd within
        ``probe_timeout_s``: refused when the machine's daemons died, silent when it is cut off).
        Slurm alone would confirm a lost node only after SlurmdTimeout. Never raises."""
        slurm_view, slurmd_view = await asyncio.gather(self._probe_slurm(node), self._probe_slurmd(node))
        return ProbeResult(slurm_view.reachable and slurmd_view.reachable,
                           f"{slurm_view.detail}; {slurmd_view.detail}")

    async def _probe_slurm(self, node: NodeInfo) -> ProbeResult:
        try:
            rec = await self.commands.show_node(node.name)
            nv = map_node_state(rec.get("State", "UNKNOWN"))
            jv = await self.commands.job_verdict(node.backend_ref) if node.backend_ref else None
        except BackendError as exc:
            return ProbeResult(False, f"{node.name}: slurm query failed: {exc}")
        job_ok = jv is None or jv.outcome is JobOutcome.RUNNING
        detail = f"{node.name}: node {nv.state} ({nv.health}, {nv.reason})"
        if jv is not None:
            detail += f"; job {node.backend_ref} {jv.outcome} ({jv.reason})"
        return ProbeResult(nv.reachable and job_ok, detail)

    async def _probe_slurmd(self, node: NodeInfo) -> ProbeResult:
        """TCP connect to ``node.host``:SlurmdPort (connect, then close at once)."""
        port = await self.commands.slurmd_port()
        address = node.host or node.name
        t0 = time.perf_counter()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), self.probe_timeout_s)
        except (TimeoutError, OSError) as exc:
            why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
            return ProbeResult(False, f"slurmd on {node.name} ({address}:{port}) unreachable after "
                                      f"{time.perf_counter() - t0:.1f}s: {why}")
        writer.close()
        return ProbeResult(True, f"slurmd on {node.name} answers ({time.perf_counter() - t0:.2f}s)")

    async def release(self, nodes: list[NodeInfo]) -> None:
        """Stop the agents (stop marker) and cancel the nodes' allocations. Idempotent."""
        for node in nodes:
            if node.backend_ref:
                (self.slurm_dir / "agents").mkdir(parents=True, exist_ok=True)
                (self.slurm_dir / "agents" / f"{node.name}-{node.backend_ref}.stop").touch()
                self.config_path(node).unlink(missing_ok=True)
        await self.commands.scancel([n.backend_ref for n in nodes if n.backend_ref])
        for node in nodes:
            self._state.get("nodes", {}).pop(node.name, None)
        self._save_state()

    async def release_all(self) -> None:
        """Cancel every array this backend submitted for the job (pending ones too) and wait until
        squeue no longer lists them (bounded by ``command_timeout_s``)."""
        arrays = [a["array_job_id"] for a in self._state.get("arrays", [])]
        await self.commands.scancel(arrays)
        deadline = time.monotonic() + self.command_timeout_s
        while time.monotonic() < deadline:
            live = [t for t in await self.commands.squeue() if t.array_job_id in arrays
                    and not map_job_state(t.state).terminal]
            if not live:
                break
            await asyncio.sleep(POLL_S)
        for path in (self.slurm_dir / "agents").glob("*.json"):
            path.unlink(missing_ok=True)
        self._state["nodes"] = {}
        self._save_state()

    async def inject(self, node: NodeInfo, kind: str, params: dict[str, Any]) -> bool:
        """Backend-level faults through the injector given at construction (the lab's:
        ``partition``, ``node-down``, ``slow-link``); False without one."""
        if self._faults is None:
            return False
        return await self._faults.inject(node.name, kind, params)

    async def close(self) -> None:
        """Cancel the fault injector's pending undo timers; no connections are held between calls."""
        if self._faults is not None:
            await self._faults.close()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically as a new 0600 file (a new inode every time)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def script_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """What the sbatch scripts take from a ``[cluster.slurm]`` table. Pure."""
    return {"partition": str(cfg.get("partition", "")), "account": str(cfg.get("account", "")),
            "time_limit": str(cfg.get("time_limit", "")), "python": str(cfg.get("python", "python3")),
            "exclude": frozenset(cfg.get("exclude", [])), "extra_sbatch": tuple(cfg.get("extra_sbatch", []))}


def scripts_from_config(cfg: dict[str, Any], job_dir: Path) -> SbatchScripts:
    """The sbatch scripts a job with this ``[cluster.slurm]`` table and job directory submits. Pure."""
    settings = script_settings(cfg)
    return SbatchScripts(job_dir / "slurm", settings["partition"], settings["account"], settings["time_limit"],
                         settings["python"], settings["exclude"], settings["extra_sbatch"])
