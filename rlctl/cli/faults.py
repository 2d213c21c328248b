"""`rlctl inject-fault` and `rlctl chaos`: put faults into a running job, through its controller.

The controller refuses nodes that are not in the job and kinds it does not know, and journals
every injection, so tests and benchmarks read the truth from the journal. ``inject-fault --list``
shows the pending delayed injections and the recent ones; ``--cancel FAULT_ID`` cancels a pending one.
"""

from __future__ import annotations

import random
import time
from typing import Any

import typer

from rlctl.cli.common import console, fail, job_status, print_json, resolve_job_to_act_on
from rlctl.controller.api import ApiClient, ApiError
from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from rlctl.core.faultparams import ARMABLE_PHASES, FAULT_KINDS, FaultParamError, validate_fault
from rlctl.core.injections import FAULT_EVENTS, InjectionState, book_of
from rlctl.core.states import ENDED_JOB_STATES

DEFAULT_CHAOS_KINDS = "crash,hang,node-down,xid,nccl-timeout"


def inject_fault(
    node: str = typer.Argument(None, help="Node name in the job (see `rlctl nodes`)."),
    job: str = typer.Option(None, "--job", "-j", help="Job id or prefix (default: the newest job; required when several jobs run here)."),
    kind: str = typer.Option(None, "--kind", "-k", help=f"One of: {', '.join(FAULT_KINDS)}."),
    code: float = typer.Option(None, "--code", help="XID code for --kind xid (e.g. 79, 48, 13)."),
    after: float = typer.Option(0.0, "--after", help="Seconds to wait before the fault: the injection is scheduled "
                                                     "and this command answers at once with its fault id."),
    at_phase: str = typer.Option(None, "--at-phase", metavar="PHASE", help="Arm the fault instead: it is carried "
                                 "out when a worker of NODE (the one --worker names: a slot, worker id or role) next "
                                 f"reports PHASE ({', '.join(ARMABLE_PHASES)}); answers at once with its fault id."),
    duration: float = typer.Option(None, "--duration", help="For hang/slow/partition: seconds until it heals."),
    factor: float = typer.Option(None, "--factor", help="For slow: slow-down factor (e.g. 4)."),
    ecc: str = typer.Option("dbe", "--ecc", help="For --kind ecc: sbe or dbe."),
    gpu: int = typer.Option(None, "--gpu", help="For xid/ecc: the GPU's index on the node (default 0); the "
                                                "signal is attributed to the worker on that GPU."),
    worker: str = typer.Option(None, "--worker", help="The worker to hit: a slot of the node (e.g. trainer-1) or a "
                                                      "worker id (default: the worker on --gpu, else the node's first)."),
    list_them: bool = typer.Option(False, "--list", help="List the job's pending delayed injections and the recent "
                                                         "ones, with their state; no NODE or --kind."),
    cancel: str = typer.Option(None, "--cancel", metavar="FAULT_ID", help="Cancel a pending delayed injection "
                                                                          "(see --list); no NODE or --kind."),
    json_out: bool = typer.Option(False, "--json"),
    state_dir: str = typer.Option(None, "--state-dir"),
) -> None:
    """Inject a fault into NODE of a running job. Answers once the node's agent (or the backend)
    has carried the fault out or refused it; a refusal exits non-zero with the reason. With --after
    the injection is scheduled: it answers at once, and --list / --cancel FAULT_ID follow it."""
    if list_them or cancel is not None:
        given = [name for name, value in (("NODE", node), ("--kind", kind), ("--cancel", cancel if list_them else None))
                 if value is not None]
        if given:
            fail(f"{'--list' if list_them else '--cancel'} takes no {', '.join(given)}", code=2)
        jobdir = resolve_job_to_act_on(job, state_dir, "inject-fault")
        if list_them:
            _list_injections(jobdir, json_out)
        else:
            _cancel_injection(jobdir, cancel, json_out)
        return
    if node is None or kind is None:
        fail(f"missing {' and '.join(n for n, v in (('NODE', node), ('--kind', kind)) if v is None)} "
             "(or --list, or --cancel FAULT_ID)", code=2)
    params: dict[str, object] = {"after": after}
    for key, value in (("code", code), ("duration", duration), ("factor", factor), ("gpu", gpu), ("worker", worker),
                       ("at_phase", at_phase)):
        if value is not None:
            params[key] = value
    if kind == "ecc":
        params["kind"] = ecc
    try:
        params = validate_fault(kind, params)
    except FaultParamError as exc:
        fail(str(exc), code=2)
    jobdir = resolve_job_to_act_on(job, state_dir, "inject-fault")
    try:
        # Answered after the agent's answer (up to 10 s); a delayed injection at once.
        result = ApiClient(jobdir.api_socket, timeout_s=20.0).call("inject", node=node, kind=kind, params=params)
    except ApiError as exc:
        fail(str(exc))
    if json_out:
        print_json({k: result[k] for k in ("fault_id", "node", "kind")}
                   | {"job_id": jobdir.job_id, "state": result.get("state", "carried-out"), "due_at": result.get("due_at"),
                      "at_phase": result.get("at_phase")})
    elif result.get("at_phase"):
        console.print(f"armed {kind} for {node} of {jobdir.job_id}: carried out when {worker or 'a worker'} there "
                      f"reports {result['at_phase']} (fault {result['fault_id']}; "
                      f"`rlctl inject-fault --cancel {result['fault_id']}` cancels it)")
    elif result.get("state") == InjectionState.PENDING:
        console.print(f"scheduled {kind} into {node} of {jobdir.job_id} in {after:g} s (fault {result['fault_id']}; "
                      f"`rlctl inject-fault --cancel {result['fault_id']}` cancels it)")
    else:
        console.print(f"injected {kind} into {node} of {jobdir.job_id} (fault {result['fault_id']})")


def _list_injections(jobdir: JobDir, json_out: bool) -> None:
    """From the live controller; with none, from the journal (nothing is pending without a controller:
    `rlctl resume` arms the pending ones again)."""
    client = ApiClient(jobdir.api_socket)
    injections: list[dict[str, Any]] | None = None
    if client.available():
        try:
            injections = client.call("injections")["injections"]
        except ApiError:
            injections = None
    live = injections is not None
    if injections is None:
        journal = Journal(jobdir.journal, readonly=True)
        try:
            book = book_of(journal.read(types=tuple(FAULT_EVENTS)))
        finally:
            journal.close()
        injections = [i.as_dict() for i in book.listing()]
    if json_out:
        print_json({"job_id": jobdir.job_id, "controller_live": live, "injections": injections})
        return
    if not injections:
        console.print(f"no injections in {jobdir.job_id}")
        return
    now = time.time()
    for item in injections:
        when = (f"due in {item['due_at'] - now:.0f} s" if item["state"] == InjectionState.PENDING
                else time.strftime("%H:%M:%S", time.localtime(item["settled_at"] or item["due_at"])))
        reason = f": {item['reason']}" if item["reason"] else ""
        console.print(f"{item['fault_id']}  {item['state']:<11} {item['kind']} on {item['node']}, {when}{reason}",
                      highlight=False)
    if not live:
        console.print(f"(no controller answers for {jobdir.job_id}: read from its journal)")


def _cancel_injection(jobdir: JobDir, fault_id: str, json_out: bool) -> None:
    try:
        result = ApiClient(jobdir.api_socket).call("cancel", fault_id=fault_id)
    except ApiError as exc:
        fail(str(exc))
    if json_out:
        print_json({k: result[k] for k in ("fault_id", "node", "kind", "state")} | {"job_id": jobdir.job_id})
    else:
        console.print(f"cancelled {result['kind']} on {result['node']} of {jobdir.job_id} (fault {fault_id})")


def chaos(
    job: str = typer.Argument(None, help="Job id or prefix (default: the newest job; required when several jobs run here)."),
    rate: float = typer.Option(0.1, "--rate", help="Per-step probability that a fault hits one random node."),
    kinds: str = typer.Option(DEFAULT_CHAOS_KINDS, "--kinds", help="Comma-separated fault kinds to draw from."),
    seed: int = typer.Option(0, "--seed", help="Seed for the draws (reproducible soak)."),
    duration: float = typer.Option(None, "--duration", help="Stop after this many seconds (default: until the job ends)."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per injection, then a summary."),
    state_dir: str = typer.Option(None, "--state-dir"),
) -> None:
    """Soak a job: at each new RL step, with probability RATE, inject a random fault into a random node."""
    chosen = [k.strip() for k in kinds.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in FAULT_KINDS]
    if unknown or not chosen:
        fail(f"unknown fault kind(s) {', '.join(unknown) or '(none given)'}; valid kinds: {', '.join(FAULT_KINDS)}", code=2)
    if not 0.0 <= rate <= 1.0:
        fail(f"--rate must be in [0, 1], got {rate}", code=2)
    jobdir = resolve_job_to_act_on(job, state_dir, "chaos")
    client = ApiClient(jobdir.api_socket, timeout_s=25.0)  # an injection is answered after the agent's ack
    rng = random.Random(seed)
    deadline = time.monotonic() + duration if duration else None
    injected: list[dict[str, object]] = []
    last_step = None
    while deadline is None or time.monotonic() < deadline:
        snap = job_status(jobdir)
        if snap["job"]["state"] in ENDED_JOB_STATES:
            break
        step = snap["job"]["step"]
        if step != last_step:
            last_step = step
            if rng.random() < rate:
                record = _inject_random(client, snap, chosen, rng)
                if record is not None:
                    record["step"] = step
                    injected.append(record)
                    if json_out:
                        print_json(record)
                    else:
                        console.print(f"step {step}: injected {record['kind']} into {record['node']}")
        time.sleep(0.3)
    summary = {"job_id": jobdir.job_id, "injected": len(injected), "rate": rate, "seed": seed}
    if json_out:
        print_json(summary)
    else:
        console.print(f"chaos done: {len(injected)} fault(s) injected into {jobdir.job_id}")


def _inject_random(client: object, snap: dict, kinds: list[str], rng: random.Random) -> dict[str, object] | None:
    candidates = [n["name"] for n in snap["nodes"] if n["state"] in ("active", "standby") and n.get("slot")]
    if not candidates:
        return None
    node = rng.choice(sorted(candidates))
    kind = rng.choice(kinds)
    params: dict[str, object] = {}
    if kind == "xid":
        params["code"] = rng.choice([79, 48, 13])
    if kind in ("hang", "slow"):
        params["duration"] = 30.0
    try:
        result = client.call("inject", node=node, kind=kind, params=params)  # type: ignore[attr-defined]
    except ApiError as exc:
        return {"node": node, "kind": kind, "error": str(exc)}
    return {"node": node, "kind": kind, "fault_id": result["fault_id"], "params": params}
