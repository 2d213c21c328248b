"""Bench helper: processes on lab nodes, each behind its own rate-limited link (as root).

A weight-sync figure taken on one loopback shares one machine's cores and memory bandwidth
between every sender and receiver, which is not what spreading a transfer over many senders is
for (many hosts, each with its own NIC). ``ShapedNodes`` puts each sender on a lab node
(``rlctl.lab.network``: its own network namespace on the lab bridge) whose eth0 sends at most
``link_mbit`` (a ``tbf`` qdisc), with the receivers on the bridge. The lab network must not be up
already; it is deleted on ``close``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence


class ShapedNodes:
    """``count`` lab nodes (node01, node02, ...) whose links send at most ``link_mbit``."""

    def __init__(self, count: int, link_mbit: int) -> None:
        from rlctl.lab import config, network
        from rlctl.lab.shell import run

        if network.link_exists(config.BRIDGE):
            raise SystemExit("the lab network is up (rlctl lab down first): this bench makes and deletes its own")
        self._network, self._config = network, config
        self.processes: list[subprocess.Popen[str]] = []
        network.ensure_bridge()
        self.nodes = [f"node{index + 1:02d}" for index in range(count)]
        for node in self.nodes:
            network.ensure_node_netns(node)
            run(["ip", "netns", "exec", config.netns(node), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                 "rate", f"{link_mbit}mbit", "burst", "1mb", "latency", "100ms"])

    def ip(self, index: int) -> str:
        return str(self._config.node_ip(self.nodes[index]))

    def spawn(self, index: int, argv: Sequence[str]) -> subprocess.Popen[str]:
        """Run ``python argv...`` on node ``index``, with pipes to talk to it line by line."""
        process = subprocess.Popen(["ip", "netns", "exec", self._config.netns(self.nodes[index]), sys.executable, *argv],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        self._network.delete_network()
