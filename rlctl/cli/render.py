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

from rlctl.core.events import EventKind

DETAIL_NODES = 24
ATTENTION_STATES = frozenset({"suspect", "failed", "draining", "starting", "allocating"})
GONE_STATES = frozenset({"released"})  # given back: no heartbeat or phase of theirs means anything now
STATE_STYLE = {
    "running": "green", "active": "green", "ready": "cyan", "standby": "cyan", "succeeded": "bold green",
    "starting": "yellow", "recovering": "yellow", "suspect": "yellow", "stopping": "yellow", "pending": "dim",
    "failed": "bold red", "stopped": "dim", "released": "dim", "draining": "magenta", "exited": "dim",
}


def styled(state: str | None) -> Text:
    return Text(state or "-", style=STATE_STYLE.get(state or "", ""))


def render_status(status: dict[str, Any], width: int = 120) -> Group:
    """The whole view for a terminal ``width`` columns wide (tables drop columns rather than wrap)."""
    return Group(header(status), roles_table(status, width), round_panel(status), nodes_table(status, width),
                 events_table(status))


def reward_text(status: dict[str, Any]) -> Text:
    """Reward as a trend a person can read: the moving average per round kind (a long round's
    prompts are the hard ones, so mixing kinds makes a falling line out of a rising one)."""
    trend = status.get("reward_trend") or {}
    text = Text()
    for kind in ("short", "sync", "long"):
        entry = trend.get(kind)
        if entry:
            text.append("reward " if not text.plain else "  ")
            text.append(f"{kind} {entry['mean']:.3f}", style={"short": "cyan", "long": "magenta"}.get(kind, ""))
            text.append(f" (avg {entry['steps']})", style="dim")
    return text


def held_out_text(status: dict[str, Any]) -> Text:
    """The latest held-out reward, the version it scored and the first evaluation's (empty without one)."""
    held_out = status.get("held_out") or []
    text = Text()
    if held_out:
        first, last = held_out[0], held_out[-1]
        text.append(f"held-out reward {last['reward_mean']:.3f}", style="green")
        text.append(f" ± {last['reward_std_err']:.3f} at v{last['version']}", style="dim")
        if len(held_out) > 1:
            text.append(f"  (v{first['version']}: {first['reward_mean']:.3f})", style="dim")
    return text


def reward_function_text(status: dict[str, Any]) -> Text:
    """The reward function's failures: a red line while most recent calls fail (the job trains on
    zeros), a dim count once any call failed, nothing otherwise."""
    calls = status.get("reward_function") or {}
    text = Text()
    if not calls.get("failures"):
        return text
    if calls.get("failing"):
        text.append(f"reward function {calls['function']} failing: ", style="bold red")
        text.append(f"{calls['window_failures']} of the last {calls['window_calls']} calls failed, "
                    f"{calls['consecutive_failures']} in a row; last error: {calls['last_error']}", style="red")
    else:
        text.append(f"reward function {calls['function']}: {calls['failures']} of {calls['calls']} calls failed; "
                    f"last error: {calls['last_error']}", style="dim")
    return text


def header(status: dict[str, Any]) -> Panel:
    job = status["job"]
    ledger = job.get("ledger_s", {})
    line = Text()
    line.append(f"{job['id']}  ", style="bold")
    line.append_text(styled(job["state"]))
    line.append(f"   step {job['step']}/{job['total_steps']}   elapsed {_duration(job['elapsed_s'])}   ")
    line.append(f"ETTR {job['ettr'] * 100:.1f}%", style="bold")
    line.append(f"   policy {job['policy']}")
    parts = "  ".join(f"{k} {_duration(v)}" for k, v in ledger.items() if v > 0)
    sub = Text(f"ledger: {parts or '-'}   weights v{job['weights_version']}   checkpoint step {job['checkpoint_step']}",
               style="dim")
    controller = status.get("controller", {})
    if not controller.get("live"):
        sub.append("   (controller not running: view rebuilt from the journal)", style="yellow")
    stopped = Text(str(controller["stopped"]), style="bold red") if controller.get("stopped") else Text()
    rows = [line] + [text for text in (reward_function_text(status), reward_text(status), held_out_text(status))
                     if text.plain] + [sub] + ([stopped] if stopped.plain else [])
    return Panel(Group(*rows), title="rlctl", border_style="blue")


def fitting_columns(columns: list[tuple[str, str, int]], width: int) -> list[tuple[str, str, int]]:
    """Columns ``(wide header, narrow header, width)`` in priority order, kept while they fit
    ``width`` (three characters of borders and padding each); at least the first two."""
    kept: list[tuple[str, str, int]] = []
    used = 1
    for column in columns:
        if len(kept) >= 2 and used + column[2] + 3 > width:
            continue
        kept.append(column)
        used += column[2] + 3
    return kept


def _table(title: str, columns: list[tuple[str, str, int]], width: int) -> tuple[Table, list[str]]:
    kept = fitting_columns(columns, width)
    narrow = width < 100
    table = Table(title=title, expand=True, title_justify="left", pad_edge=not narrow)
    for wide, short, _ in kept:
        table.add_column(short if narrow else wide, no_wrap=True, overflow="ellipsis")
    return table, [c[0] for c in kept]


ROLE_COLUMNS = [("role", "role", 8), ("workers", "n", 3), ("states", "states", 22), ("weights", "w", 5),
                ("phases", "phases", 24)]


def roles_table(status: dict[str, Any], width: int = 120) -> Table:
    table, columns = _table("roles", ROLE_COLUMNS, width)
    for role in status["roles"]:
        version = role.get("weights_version")
        cells = {"role": role["role"], "workers": str(role["slots"]),
                 "states": ", ".join(f"{k} {v}" for k, v in sorted(role["states"].items())) or "-",
                 "phases": ", ".join(role["phases"]) or "-", "weights": f"v{version}" if version is not None else "-"}
        table.add_row(*(cells[c] for c in columns))
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
    line.append(f"  cap {rnd['max_new_tokens']} tokens  {groups_text(rnd)}  "
                f"samples {rnd['samples_generated']}/{rnd['samples_total']}  longest {rnd['longest_response']}  "
                f"deferred {rnd['deferred']}  long queue {rnd['long_queue']}  pool {rnd['pool']}  epoch {rnd['epoch']}")
    rows: list[Any] = [line]
    held_out = rnd.get("held_out")
    if held_out:
        rows.append(Text(f"held-out evaluation of v{held_out['version']}: "
                         f"{held_out['samples_scored']}/{held_out['samples_total']} scored", style="green"))
    rows.append(ProgressBar(total=target, completed=min(done, target), width=60))
    return Panel(Group(*rows), title="rollout round", border_style=kind_style)


def groups_text(rnd: dict[str, Any]) -> str:
    """A round's finished groups against its target; groups finished beyond the target (the
    over-provisioned ones that completed before the round closed) are counted apart, and so are the
    groups dynamic sampling dropped, with the draw of prompts the round is on."""
    done, target = rnd["groups_done"], rnd["groups_target"]
    extra = f" (+{done - target} extra)" if done > target else ""
    filtered = (f"  filtered {rnd['groups_filtered']} (gen batch {rnd.get('gen_batches', 1)})"
                if rnd.get("groups_filtered") or rnd.get("gen_batches", 1) > 1 else "")
    return f"groups {min(done, target)}/{target}{extra}{filtered}"


# (wide header, narrow header, width) in the order columns drop out as the terminal narrows.
NODE_COLUMNS = [("node", "node", 8), ("role", "role", 7), ("state", "state", 7), ("worker", "worker", 7),
                ("heartbeat", "hb", 5), ("phase", "phase", 13), ("GPU util", "util", 4), ("last signal", "signal", 14),
                ("GPU temp", "temp", 4), ("GPU mem", "mem", 9)]


def nodes_table(status: dict[str, Any], width: int = 120) -> Table:
    nodes = status["nodes"]
    table, columns = _table(f"nodes ({len(nodes)})", NODE_COLUMNS, width)
    shown = nodes
    if len(nodes) > DETAIL_NODES:
        shown = [n for n in nodes if n["state"] in ATTENTION_STATES or (n.get("worker_state") or "") in ("failed", "suspect")]
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for node in nodes:
            if node not in shown:
                groups.setdefault((node["role"], node["state"]), []).append(node)
        for (role, state), members in sorted(groups.items()):
            ages = [n["heartbeat_age_s"] for n in members
                    if n["heartbeat_age_s"] is not None and n["state"] not in GONE_STATES]
            utils = [n["gpu_util"] for n in members if n["gpu_util"] is not None]
            group: dict[str, str | Text] = {"node": f"{len(members)} nodes", "role": role, "state": styled(state),
                     "heartbeat": f"max {max(ages):.1f}s" if ages else "-",
                     "GPU util": f"{sum(utils) / len(utils):.0f}%" if utils else "-"}
            table.add_row(*(group.get(c, "") for c in columns))
    for node in shown:
        mem = "-"
        if node.get("gpu_mem_total"):
            mem = f"{node['gpu_mem_used'] / 2**30:.1f}/{node['gpu_mem_total'] / 2**30:.0f}G"
        gone = node["state"] in GONE_STATES
        age = None if gone else node["heartbeat_age_s"]
        cells: dict[str, str | Text] = {
            "node": node["name"], "role": node["role"], "state": styled(node["state"]),
            "worker": styled(node.get("worker_state")), "phase": "-" if gone else node.get("phase") or "-",
            "heartbeat": f"{age:.1f}s" if age is not None else "-",
            "GPU util": f"{node['gpu_util']:.0f}%" if node.get("gpu_util") is not None else "-",
            "GPU temp": f"{node['gpu_temp_c']:.0f}C" if node.get("gpu_temp_c") is not None else "-",
            "GPU mem": mem, "last signal": node.get("last_signal") or "",
        }
        table.add_row(*(cells[c] for c in columns))
    return table


def events_table(status: dict[str, Any]) -> Table:
    table = Table(title="latest events", expand=True, title_justify="left", show_header=False)
    table.add_column("seq", style="dim", width=6)
    table.add_column("type", width=18)
    table.add_column("detail", overflow="fold")
    for ev in status.get("events", [])[-8:]:
        red = (EventKind.VERDICT, EventKind.FAULT_INJECTED, EventKind.REWARD_FUNCTION_FAILING)
        style = "red" if ev["type"] in red else ("yellow" if ev["type"] == EventKind.ACTION_TAKEN else "")
        table.add_row(str(ev["seq"]), Text(ev["type"], style=style), ev["summary"])
    return table


def status_line(status: dict[str, Any]) -> str:
    """One plain line for non-terminal output (CI logs)."""
    job, rnd = status["job"], status.get("round") or {}
    parts = [
        f"{job['id']} {job['state']}", f"step {job['step']}/{job['total_steps']}", f"ETTR {job['ettr'] * 100:.1f}%",
        reward_text(status).plain or "reward -",
    ]
    if held_out_text(status).plain:
        parts.append(held_out_text(status).plain)
    if "step" in rnd:
        parts.append(f"{rnd['kind']} round {groups_text(rnd)} longest {rnd['longest_response']}")
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
