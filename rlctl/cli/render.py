"""Rich renderables for the status view, built from a status snapshot (see rlctl.core.snapshot).

Readable at 1,024 nodes: beyond ``DETAIL_NODES`` nodes the node table condenses healthy nodes
into one row per (role, state) and lists only the nodes that need attention.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

DETAIL_NODES = 24
ATTENTION_STATES = frozenset({"suspect", "failed", "draining", "starting", "allocating"})
STATE_STYLE = {
    "running": "green", "active": "green", "ready": "cyan", "standby": "cyan", "succeeded": "bold green",
    "starting": "yellow", "recovering": "yellow", "suspect": "yellow", "stopping": "yellow", "pending": "dim",
    "failed": "bold red", "stopped": "dim", "released": "dim", "draining": "magenta", "exited": "dim",
}


def styled(state: str | None) -> Text:
    return Text(state or "-", style=STATE_STYLE.get(state or "", ""))


def render_status(status: dict[str, Any]) -> Group:
    return Group(header(status), roles_table(status), round_panel(status), nodes_table(status), events_table(status))


def header(status: dict[str, Any]) -> Panel:
    job = status["job"]
    ledger = job.get("ledger_s", {})
    reward = job.get("mean_reward")
    line = Text()
    line.append(f"{job['id']}  ", style="bold")
    line.append_text(styled(job["state"]))
    line.append(f"   step {job['step']}/{job['total_steps']}   elapsed {_duration(job['elapsed_s'])}   ")
    line.append(f"ETTR {job['ettr'] * 100:.1f}%", style="bold")
    line.append(f"   policy {job['policy']}")
    if reward is not None:
        line.append(f"   reward {reward:.3f}")
    parts = "  ".join(f"{k} {_duration(v)}" for k, v in ledger.items() if v > 0)
    sub = Text(f"ledger: {parts or '-'}   weights v{job['weights_version']}   checkpoint step {job['checkpoint_step']}",
               style="dim")
    controller = status.get("controller", {})
    if not controller.get("live"):
        sub.append("   (controller not running: view rebuilt from the journal)", style="yellow")
    return Panel(Group(line, sub), title="rlctl", border_style="blue")


def roles_table(status: dict[str, Any]) -> Table:
    table = Table(title="roles", expand=True, title_justify="left")
    for column in ("role", "workers", "states", "phases", "weights"):
        table.add_column(column)
    for role in status["roles"]:
        states = ", ".join(f"{k} {v}" for k, v in sorted(role["states"].items())) or "-"
        version = role.get("weights_version")
        table.add_row(role["role"], str(role["slots"]), states, ", ".join(role["phases"]) or "-",
                      f"v{version}" if version is not None else "-")
    return table


def round_panel(status: dict[str, Any]) -> Panel:
    rnd = status.get("round") or {}
    if "step" not in rnd:
        return Panel(Text("no round yet", style="dim"), title="rollout round", border_style="dim")
    done, target = rnd["groups_done"], max(rnd["groups_target"], 1)
    kind_style = {"short": "cyan", "long": "magenta", "sync": "white"}.get(rnd["kind"], "white")
    line = Text()
    line.append(f"step {rnd['step']}  ")
    line.append(f"{rnd['kind']} round", style=f"bold {kind_style}")
    line.append(f"  cap {rnd['max_new_tokens']} tokens  groups {done}/{rnd['groups_target']}  "
                f"samples {rnd['samples_generated']}/{rnd['samples_total']}  longest {rnd['longest_response']}  "
                f"deferred {rnd['deferred']}  long queue {rnd['long_queue']}  pool {rnd['pool']}  epoch {rnd['epoch']}")
    bar = ProgressBar(total=target, completed=min(done, target), width=60)
    return Panel(Group(line, bar), title="rollout round", border_style=kind_style)


def nodes_table(status: dict[str, Any]) -> Table:
    nodes = status["nodes"]
    table = Table(title=f"nodes ({len(nodes)})", expand=True, title_justify="left")
    for column in ("node", "role", "state", "worker", "phase", "heartbeat", "GPU util", "GPU temp", "GPU mem", "last signal"):
        table.add_column(column, overflow="fold")
    shown = nodes
    if len(nodes) > DETAIL_NODES:
        shown = [n for n in nodes if n["state"] in ATTENTION_STATES or (n.get("worker_state") or "") in ("failed", "suspect")]
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for node in nodes:
            if node not in shown:
                groups.setdefault((node["role"], node["state"]), []).append(node)
        for (role, state), members in sorted(groups.items()):
            ages = [n["heartbeat_age_s"] for n in members if n["heartbeat_age_s"] is not None]
            utils = [n["gpu_util"] for n in members if n["gpu_util"] is not None]
            table.add_row(f"{len(members)} nodes", role, styled(state), "", "",
                          f"max {max(ages):.1f}s" if ages else "-", f"{sum(utils) / len(utils):.0f}%" if utils else "-",
                          "", "", "")
    for node in shown:
        mem = "-"
        if node.get("gpu_mem_total"):
            mem = f"{node['gpu_mem_used'] / 2**30:.1f}/{node['gpu_mem_total'] / 2**30:.0f}G"
        age = node["heartbeat_age_s"]
        table.add_row(
            node["name"], node["role"], styled(node["state"]), styled(node.get("worker_state")), node.get("phase") or "-",
            f"{age:.1f}s" if age is not None else "-",
            f"{node['gpu_util']:.0f}%" if node.get("gpu_util") is not None else "-",
            f"{node['gpu_temp_c']:.0f}C" if node.get("gpu_temp_c") is not None else "-",
            mem, node.get("last_signal") or "",
        )
    return table


def events_table(status: dict[str, Any]) -> Table:
    table = Table(title="latest events", expand=True, title_justify="left", show_header=False)
    table.add_column("seq", style="dim", width=6)
    table.add_column("type", width=18)
    table.add_column("detail", overflow="fold")
    for ev in status.get("events", [])[-8:]:
        style = "red" if ev["type"] in ("Verdict", "FaultInjected") else ("yellow" if ev["type"] == "ActionTaken" else "")
        table.add_row(str(ev["seq"]), Text(ev["type"], style=style), ev["summary"])
    return table


def status_line(status: dict[str, Any]) -> str:
    """One plain line for non-terminal output (CI logs)."""
    job, rnd = status["job"], status.get("round") or {}
    reward = job.get("mean_reward")
    parts = [
        f"{job['id']} {job['state']}", f"step {job['step']}/{job['total_steps']}", f"ETTR {job['ettr'] * 100:.1f}%",
        f"reward {reward:.3f}" if reward is not None else "reward -",
    ]
    if "step" in rnd:
        parts.append(f"{rnd['kind']} round {rnd['groups_done']}/{rnd['groups_target']} longest {rnd['longest_response']}")
    unhealthy = [n["name"] for n in status["nodes"] if n["state"] in ("suspect", "failed")]
    if unhealthy:
        parts.append("attention: " + ",".join(unhealthy))
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{sec:02d}s"
