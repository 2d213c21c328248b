"""`rlctl inject-fault` and `rlctl chaos`: put faults into a running job, through its controller.

The controller refuses nodes that are not in the job and kinds it does not know, and journals
every injection, so tests and benchmarks read the truth from the journal.
"""

from __future__ import annotations

import random
import time

import typer

from rlctl.cli.common import console, fail, job_status, print_json, resolve_job
from rlctl.controller.api import ApiClient, ApiError
from rlctl.core.faultparams import FAULT_KINDS, FaultParamError, validate_fault

DEFAULT_CHAOS_KINDS = "crash,hang,node-down,xid,nccl-timeout"


def inject_fault(
    node: str = typer.Argument(..., help="Node name in the job (see `rlctl nodes`)."),
    job: str = typer.Option(None, "--job", "-j", help="Job id or prefix (default: the newest job)."),
    kind: str = typer.Option(..., "--kind", "-k", help=f"One of: {', '.join(FAULT_KINDS)}."),
    code: int = typer.Option(None, "--code", help="XID code for --kind xid (e.g. 79, 48, 13)."),
    after: float = typer.Option(0.0, "--after", help="Seconds to wait before the fault."),
    duration: float = typer.Option(None, "--duration", help="For hang/slow/partition: seconds until it heals."),
    factor: float = typer.Option(None, "--factor", help="For slow: slow-down factor (e.g. 4)."),
    ecc: str = typer.Option("dbe", "--ecc", help="For --kind ecc: sbe or dbe."),
    gpu: int = typer.Option(None, "--gpu", help="For xid/ecc: the GPU's index on the node (default 0); the "
                                                "signal is attributed to the worker on that GPU."),
    worker: str = typer.Option(None, "--worker", help="The worker to hit: a slot of the node (e.g. trainer-1) or a "
                                                      "worker id (default: the worker on --gpu, else the node's first)."),
    json_out: bool = typer.Option(False, "--json"),
    state_dir: str = typer.Option(None, "--state-dir"),
) -> None:
    """Inject a fault into NODE of a running job. Answers once the node's agent (or the backend)
    has carried the fault out or refused it; a refusal exits non-zero with the reason."""
    params: dict[str, object] = {"after": after}
    for key, value in (("code", code), ("duration", duration), ("factor", factor), ("gpu", gpu), ("worker", worker)):
        if value is not None:
            params[key] = value
    if kind == "ecc":
        params["kind"] = ecc
    try:
        validate_fault(kind, params)
    except FaultParamError as exc:
        fail(str(exc), code=2)
    jobdir = resolve_job(job, state_dir)
    try:
        # The controller waits --after seconds, then the agent's answer (up to 10 s).
        result = ApiClient(jobdir.api_socket, timeout_s=after + 20.0).call("inject", node=node, kind=kind, params=params)
    except ApiError as exc:
        fail(str(exc))
    if json_out:
        print_json({k: result[k] for k in ("fault_id", "node", "kind")} | {"job_id": jobdir.job_id})
    else:
        console.print(f"injected {kind} into {node} of {jobdir.job_id} (fault {result['fault_id']})")


def chaos(
    job: str = typer.Argument(None, help="Job id or prefix (default: the newest job)."),
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
    jobdir = resolve_job(job, state_dir)
    client = ApiClient(jobdir.api_socket, timeout_s=25.0)  # an injection is answered after the agent's ack
    rng = random.Random(seed)
    deadline = time.monotonic() + duration if duration else None
    injected: list[dict[str, object]] = []
    last_step = None
    while deadline is None or time.monotonic() < deadline:
        snap = job_status(jobdir)
        if snap["job"]["state"] in ("succeeded", "stopped", "failed"):
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
