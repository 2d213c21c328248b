"""Slurm job and node states translated into rlctl's terms, keeping hardware apart from application.

Pure functions over two tables; no I/O. The key rule (see DESIGN.md, "hardware faults stay
distinct from application exits"): NODE_FAIL, BOOT_FAIL, PREEMPTED, TIMEOUT and a DOWN/DRAIN/
NOT_RESPONDING node are *infrastructure* events that lead to node replacement; only FAILED with
an exit code (or OUT_OF_MEMORY) is the application's own failure, handled by restarting the
role worker. torchx folds NODE_FAIL into FAILED; rlctl must not.

Job states: ``squeue --json`` ``job_state`` / ``scontrol show job -o`` ``JobState``.
Node states: ``scontrol show node -o`` ``State=`` (``BASE[*][+FLAG...]``) or ``sinfo %T`` (lower case,
``drained``/``draining``, ``*`` suffix for not responding).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class JobOutcome(StrEnum):
    """What a Slurm job (one node's allocation) means for rlctl."""

    PENDING = "pending"                  # waiting for resources; not a fault
    RUNNING = "running"                  # allocation held, agent may run
    SUCCEEDED = "succeeded"              # ended with exit 0 (released normally)
    APP_FAILED = "app-failed"            # the program failed: restart the role worker
    HARDWARE_FAILED = "hardware-failed"  # the node failed: replace the node
    PREEMPTED = "preempted"              # taken by the scheduler: replace, not the app's fault
    TIMEOUT = "timeout"                  # time limit hit: reallocate, not the app's fault
    CANCELLED = "cancelled"              # someone ran scancel (rlctl release or an operator)
    UNKNOWN = "unknown"                  # a state this table does not know: treat as suspect


# state -> (outcome, termination reason, terminal?)
JOB_STATES: dict[str, tuple[JobOutcome, str, bool]] = {
    # Queued: resources not yet granted.
    "PENDING": (JobOutcome.PENDING, "slurm-pending", False),
    # Nodes are booting/being configured for the job; still waiting.
    "CONFIGURING": (JobOutcome.PENDING, "slurm-configuring", False),
    # Requeued jobs go back to pending (rlctl submits with --no-requeue, so only an operator does this).
    "REQUEUED": (JobOutcome.PENDING, "slurm-requeued", False),
    "REQUEUE_FED": (JobOutcome.PENDING, "slurm-requeued", False),
    "REQUEUE_HOLD": (JobOutcome.PENDING, "slurm-requeued", False),
    # Allocation is held and the batch script runs.
    "RUNNING": (JobOutcome.RUNNING, "slurm-running", False),
    # Being resized (scontrol update NumNodes); still running.
    "RESIZING": (JobOutcome.RUNNING, "slurm-resizing", False),
    # Signalling the job; still running.
    "SIGNALING": (JobOutcome.RUNNING, "slurm-signaling", False),
    # Processes are ending; the outcome is decided by the exit code once it completes.
    "COMPLETING": (JobOutcome.RUNNING, "slurm-completing", False),
    # Ran to the end with exit code 0.
    "COMPLETED": (JobOutcome.SUCCEEDED, "exit-code-0", True),
    # Non-zero exit of the program itself: the application's failure.
    "FAILED": (JobOutcome.APP_FAILED, "exit-code", True),
    # The kernel OOM killer hit the job: the application asked for too much memory.
    "OUT_OF_MEMORY": (JobOutcome.APP_FAILED, "out-of-memory", True),
    # A node of the allocation stopped responding or went DOWN: hardware, not the app.
    "NODE_FAIL": (JobOutcome.HARDWARE_FAILED, "slurm-node-fail", True),
    # The node could not be booted for the job: hardware/infrastructure.
    "BOOT_FAIL": (JobOutcome.HARDWARE_FAILED, "slurm-boot-fail", True),
    # Launch failed on the node (prolog error, slurmd problem): infrastructure, not the app.
    "LAUNCH_FAILED": (JobOutcome.HARDWARE_FAILED, "slurm-launch-failed", True),
    # Preempted by a higher-priority job.
    "PREEMPTED": (JobOutcome.PREEMPTED, "slurm-preempted", True),
    # Hit its time limit.
    "TIMEOUT": (JobOutcome.TIMEOUT, "slurm-timeout", True),
    # Passed its --deadline.
    "DEADLINE": (JobOutcome.TIMEOUT, "slurm-deadline", True),
    # scancel (by rlctl release/replace or by an operator).
    "CANCELLED": (JobOutcome.CANCELLED, "slurm-cancelled", True),
    # Revoked by a federated sibling: not the app's fault.
    "REVOKED": (JobOutcome.CANCELLED, "slurm-revoked", True),
    # Suspended/stopped by the scheduler or an operator: not dead, but not making progress.
    "SUSPENDED": (JobOutcome.PREEMPTED, "slurm-suspended", False),
    "STOPPED": (JobOutcome.PREEMPTED, "slurm-stopped", False),
    # Held for an operator after a special exit code; the app asked for it.
    "SPECIAL_EXIT": (JobOutcome.APP_FAILED, "slurm-special-exit", True),
}


@dataclass(frozen=True)
class JobVerdict:
    """A Slurm job state in rlctl's terms. ``reason`` is a termination reason (``exit-code-3``)."""

    outcome: JobOutcome
    reason: str
    terminal: bool

    @property
    def hardware(self) -> bool:
        """True when the node (not the program) is to blame."""
        return self.outcome in (JobOutcome.HARDWARE_FAILED, JobOutcome.PREEMPTED, JobOutcome.TIMEOUT)


def map_job_state(state: str, exit_code: int | None = None, signal: int | None = None) -> JobVerdict:
    """Translate a job state (``"NODE_FAIL"``, ``"FAILED"``, ``"CANCELLED by 0"``...) plus its exit.

    ``exit_code``/``signal`` are the ``ExitCode=code:signal`` pair of ``scontrol show job``.
    """
    base = state.strip().upper().split()[0] if state.strip() else ""
    base = base.split("+")[0]
    entry = JOB_STATES.get(base)
    if entry is None:
        return JobVerdict(JobOutcome.UNKNOWN, f"slurm-{base.lower() or 'unknown'}", False)
    outcome, reason, terminal = entry
    if base == "FAILED":
        if signal:
            reason = f"signal-{signal}"
        elif exit_code is not None:
            reason = f"exit-code-{exit_code}"
    return JobVerdict(outcome, reason, terminal)


class NodeHealth(StrEnum):
    """What a Slurm node state means for rlctl."""

    HEALTHY = "healthy"          # usable (idle/allocated/mixed/completing)
    UNREACHABLE = "unreachable"  # slurmctld gets no answer from slurmd (the `*` flag)
    DOWN = "down"                # DOWN/FAIL: hardware or slurmd failure, jobs on it failed
    DRAINED = "drained"          # taken out of service by an admin or by rlctl; no new work
    MAINTENANCE = "maintenance"  # reserved for maintenance / rebooting / powered off
    UNKNOWN = "unknown"          # not yet registered or a state this table does not know


# base node state -> (health, reason)
NODE_BASE_STATES: dict[str, tuple[NodeHealth, str]] = {
    # Free and responding.
    "IDLE": (NodeHealth.HEALTHY, "slurm-idle"),
    # Fully allocated to jobs.
    "ALLOCATED": (NodeHealth.HEALTHY, "slurm-allocated"),
    "ALLOC": (NodeHealth.HEALTHY, "slurm-allocated"),
    # Partly allocated.
    "MIXED": (NodeHealth.HEALTHY, "slurm-mixed"),
    # Jobs on it are ending.
    "COMPLETING": (NodeHealth.HEALTHY, "slurm-completing"),
    # Administratively or automatically DOWN (slurmd silent past SlurmdTimeout, hardware): a fault.
    "DOWN": (NodeHealth.DOWN, "slurm-node-down"),
    # FAIL / FAILING: an admin flagged expected hardware failure.
    "FAIL": (NodeHealth.DOWN, "slurm-node-fail"),
    "FAILING": (NodeHealth.DOWN, "slurm-node-failing"),
    # sinfo-style drain states (scontrol shows these as flags instead).
    "DRAINED": (NodeHealth.DRAINED, "slurm-drained"),
    "DRAINING": (NodeHealth.DRAINED, "slurm-draining"),
    "DRAIN": (NodeHealth.DRAINED, "slurm-drained"),
    # Node exists in config but is not yet available; never allocate.
    "FUTURE": (NodeHealth.MAINTENANCE, "slurm-future"),
    "MAINT": (NodeHealth.MAINTENANCE, "slurm-maintenance"),
    "REBOOT": (NodeHealth.MAINTENANCE, "slurm-reboot"),
    "POWERED_DOWN": (NodeHealth.MAINTENANCE, "slurm-powered-down"),
    "POWER_DOWN": (NodeHealth.MAINTENANCE, "slurm-powered-down"),
    # Reserved for a reservation; healthy hardware.
    "RESERVED": (NodeHealth.HEALTHY, "slurm-reserved"),
    "PLANNED": (NodeHealth.HEALTHY, "slurm-planned"),
    # Slurmctld has not heard from the node since it started.
    "UNKNOWN": (NodeHealth.UNKNOWN, "slurm-unknown"),
}

# flags that override a healthy base state (order = precedence)
NODE_FLAG_OVERRIDES: tuple[tuple[str, NodeHealth, str], ...] = (
    # DRAIN flag on top of any base: out of service (DOWN+DRAIN stays DOWN: see below).
    ("DRAIN", NodeHealth.DRAINED, "slurm-drained"),
    # FAIL flag: admin expects hardware failure.
    ("FAIL", NodeHealth.DOWN, "slurm-node-fail"),
    ("MAINTENANCE", NodeHealth.MAINTENANCE, "slurm-maintenance"),
    ("MAINT", NodeHealth.MAINTENANCE, "slurm-maintenance"),
    ("REBOOT_REQUESTED", NodeHealth.MAINTENANCE, "slurm-reboot"),
    ("REBOOT_ISSUED", NodeHealth.MAINTENANCE, "slurm-reboot"),
    ("POWERED_DOWN", NodeHealth.MAINTENANCE, "slurm-powered-down"),
    ("NOT_RESPONDING", NodeHealth.UNREACHABLE, "slurm-not-responding"),
)


@dataclass(frozen=True)
class NodeVerdict:
    """A Slurm node state in rlctl's terms."""

    health: NodeHealth
    reason: str
    state: str

    @property
    def reachable(self) -> bool:
        """Can the node be expected to run our agent right now (the probe's answer)?"""
        return self.health in (NodeHealth.HEALTHY, NodeHealth.DRAINED)

    @property
    def hardware_fault(self) -> bool:
        return self.health in (NodeHealth.DOWN, NodeHealth.UNREACHABLE)


def map_node_state(state: str) -> NodeVerdict:
    """Translate ``IDLE``, ``DOWN*``, ``ALLOCATED+DRAIN``, ``down*``, ``drained``... into a verdict.

    Precedence: DOWN/FAIL base > not responding (``*``) > flags > base state.
    """
    raw = state.strip()
    not_responding = "*" in raw
    parts = raw.replace("*", "").replace("~", "").replace("#", "").replace("!", "").replace("%", "").upper().split("+")
    base, flags = parts[0], set(parts[1:])
    health, reason = NODE_BASE_STATES.get(base, (NodeHealth.UNKNOWN, f"slurm-{base.lower() or 'unknown'}"))
    if health is NodeHealth.DOWN:
        return NodeVerdict(health, reason, raw)
    if not_responding or "NOT_RESPONDING" in flags:
        return NodeVerdict(NodeHealth.UNREACHABLE, "slurm-not-responding", raw)
    for flag, flag_health, flag_reason in NODE_FLAG_OVERRIDES:
        if flag in flags:
            return NodeVerdict(flag_health, flag_reason, raw)
    return NodeVerdict(health, reason, raw)
