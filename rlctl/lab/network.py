"""Lab network: the bridge, one network + UTS namespace per node, /etc/hosts, link faults.

Idempotent: every ``ensure_*`` checks before it creates. Only 10.213.0.0/24 is ever configured,
on the lab bridge and inside the lab namespaces; no default route, no forwarding.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlctl.lab import config as c
from rlctl.lab.shell import LabError, run

HOSTS_FILE = Path("/etc/hosts")


def link_exists(name: str) -> bool:
    return run(["ip", "link", "show", name], check=False).returncode == 0


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def lab_netns_list() -> list[str]:
    """Names of existing lab network namespaces (``rlctl-*``)."""
    out = run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(c.NETNS_PREFIX))


def is_mountpoint(path: Path) -> bool:
    return run(["mountpoint", "-q", str(path)], check=False).returncode == 0


def ensure_bridge() -> None:
    """The bridge with the controller address 10.213.0.1/24, up."""
    if link_exists(c.BRIDGE):
        return
    clash = run(["ip", "-o", "addr", "show", "to", f"{c.CONTROLLER_IP}/32"], check=False).stdout.strip()
    if clash:
        raise LabError(f"{c.CONTROLLER_IP} is already configured elsewhere ({clash.split()[1]}); "
                       "is another lab (e.g. /work/shared/lab) running?")
    run(["ip", "link", "add", c.BRIDGE, "type", "bridge"])
    run(["ip", "addr", "add", f"{c.CONTROLLER_IP}/24", "dev", c.BRIDGE])
    run(["ip", "link", "set", c.BRIDGE, "up"])


def ensure_node_netns(node: str) -> None:
    """Network namespace + veth into the bridge + eth0 address for ``node``."""
    ns, peer = c.netns(node), c.veth(node)
    if netns_exists(ns):
        return
    run(["ip", "netns", "add", ns])
    if link_exists(peer):
        # A namespace deleted while a process still lived in it keeps its veth pair: drop the
        # stale host end (its peer goes with it) instead of failing with "File exists".
        run(["ip", "link", "del", peer])
    run(["ip", "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", peer, "master", c.BRIDGE, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{c.node_ip(node)}/24", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def tune_node_tcp(node: str) -> None:
    """Apply :data:`config.NODE_TCP_SYSCTLS` in ``node``'s namespace (idempotent)."""
    for key, value in c.NODE_TCP_SYSCTLS.items():
        # /proc/sys/net is per network namespace: written from inside the node (coreutils' tee,
        # so procps' sysctl is not needed)
        path = "/proc/sys/" + key.replace(".", "/")
        run(["nsenter", f"--net=/run/netns/{c.netns(node)}", "tee", path], input_text=value + "\n")


def ensure_uts(uts_file: Path, hostname: str) -> None:
    """A persistent UTS namespace bind-mounted at ``uts_file`` whose hostname is ``hostname``."""
    if is_mountpoint(uts_file):
        return
    uts_file.parent.mkdir(parents=True, exist_ok=True)
    uts_file.touch()
    run(["unshare", f"--uts={uts_file}", "hostname", hostname])


def in_node_argv(cfg: c.LabConfig, node: str, argv: list[str]) -> list[str]:
    """``argv`` wrapped to run inside ``node``'s network and UTS namespaces."""
    return ["nsenter", f"--net=/run/netns/{c.netns(node)}", f"--uts={cfg.uts_file(node)}", "--", *argv]


def write_hosts_block(cfg: c.LabConfig) -> None:
    """Replace the lab's marked block in /etc/hosts (controller + every node)."""
    lines = [c.HOSTS_BEGIN, f"{c.CONTROLLER_IP} {c.CONTROLLER_HOSTNAME}"]
    lines += [f"{c.node_ip(n)} {n}" for n in cfg.node_names()]
    lines.append(c.HOSTS_END)
    _write_hosts(_strip_hosts_block(_read_hosts()) + lines)


def remove_hosts_block() -> None:
    """Remove the lab's marked block from /etc/hosts (no-op when absent)."""
    current = _read_hosts()
    stripped = _strip_hosts_block(current)
    if stripped != current:
        _write_hosts(stripped)


def _read_hosts() -> list[str]:
    try:
        return HOSTS_FILE.read_text().splitlines()
    except FileNotFoundError:
        return []


def _strip_hosts_block(lines: list[str]) -> list[str]:
    out, inside = [], False
    for line in lines:
        if line.strip() == c.HOSTS_BEGIN:
            inside = True
        elif line.strip() == c.HOSTS_END:
            inside = False
        elif not inside:
            out.append(line)
    return out


def _write_hosts(lines: list[str]) -> None:
    # /etc/hosts is often a bind mount in containers: rewrite in place, never rename over it.
    with open(HOSTS_FILE, "w") as fh:
        fh.write("\n".join(lines) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def delete_network() -> None:
    """Delete every lab namespace (their veths go with them) and the bridge."""
    for ns in lab_netns_list():
        run(["ip", "netns", "del", ns], check=False)
    if link_exists(c.BRIDGE):
        run(["ip", "link", "del", c.BRIDGE])


def unmount_uts(cfg: c.LabConfig) -> None:
    """Unmount and delete every persistent UTS namespace file of the lab."""
    ns_dir = cfg.path("ns")
    for uts in sorted(ns_dir.glob("*.uts")) if ns_dir.is_dir() else []:
        if is_mountpoint(uts):
            run(["umount", str(uts)])
        uts.unlink(missing_ok=True)


# --- faults ------------------------------------------------------------------------------------
def set_link(node: str, up: bool) -> None:
    """Bring the node's link up/down (host side of its veth: the node loses all connectivity)."""
    if not netns_exists(c.netns(node)):
        raise LabError(f"no such lab node: {node}")
    run(["ip", "link", "set", c.veth(node), "up" if up else "down"])


def set_delay(node: str, delay_ms: int) -> str:
    """Slow the node's link: ``delay_ms`` of netem latency on every packet it sends.

    Kernels built without ``sch_netem`` (e.g. the Firecracker guests this project runs on) reject
    netem; then a token bucket (``tbf``) limits the link to the rate at which one 1500-byte frame
    takes ``delay_ms`` to leave, which slows every exchange by at least that much per full frame.
    Returns the method used (``"netem"`` or ``"tbf"``).
    """
    if delay_ms <= 0:
        raise LabError(f"delay must be > 0 ms, got {delay_ms} for {node}")
    prefix = ["ip", "netns", "exec", c.netns(node), "tc", "qdisc", "replace", "dev", "eth0", "root"]
    proc = run([*prefix, "netem", "delay", f"{delay_ms}ms"], check=False)
    if proc.returncode == 0:
        return "netem"
    if "unknown" not in (proc.stderr + proc.stdout).lower():
        raise LabError(f"{node}: tc netem failed: {(proc.stderr or proc.stdout).strip()}")
    rate_kbit = max(8, int(1500 * 8 / delay_ms))  # bits per ms == kbit/s
    run([*prefix, "tbf", "rate", f"{rate_kbit}kbit", "burst", "1600", "latency", "30s"])
    return "tbf"


def clear_delay(node: str) -> None:
    """Remove any netem qdisc from the node's eth0 (no-op if none)."""
    if netns_exists(c.netns(node)):
        run(["ip", "netns", "exec", c.netns(node), "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
