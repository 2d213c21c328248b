"""Worker start: a plain spawn against a fork from the host's worker template, in one run.

The agent's own ``Supervisor`` (in this process) starts the real role programs
(``python -m rlctl.roles.trainer``, ``rollout``, ``reward``) with the job's interpreter,
``--starts`` times per role and mode, one at a time. A unix socket stands in for the agent's
relay; per start it records, from the moment the supervisor is asked:

- ``hello_s``: the role's ``main`` has connected to the agent (role code is running);
- ``ready_s``: the role has imported what it needs before its model load and reached it, where it
  stops: no model is given, so it writes that error to its log (timed when the line appears, not
  at the exit, which for an interpreter holding torch takes seconds of teardown). The trainer and
  the rollout import torch, transformers and rlctl's workload code first; the reward worker reads
  the model folder before its own imports (its tokenizer), so its ``ready_s`` is only its start.

Spawn mode starts a fresh interpreter each time. Template mode asks to fork; its first start finds
no template, starts one and spawns (a real agent's start would wait for it); the bench waits for the
template to be ready and then measures. Medians are over the starts after the first.

    python bench/worker_start.py [--starts 4]

Progress goes to stderr; one JSON object is the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "agents"))

from rlctl_agent.config import AgentConfig
from rlctl_agent.supervisor import Supervisor

ROLES = ("trainer", "rollout", "reward")
TIMEOUT_S = 120.0
MODEL_ERROR = b"names no model folder"


class RelayStandIn:
    """The agent's worker socket: notes when each worker says hello."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(16)
        self.hellos: dict[str, float] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.server.accept()
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            for line in reader:
                message = json.loads(line)
                if message.get("type") == "hello":
                    with self._lock:
                        self.hellos.setdefault(str(message["wid"]), time.monotonic())

    def hello_at(self, wid: str) -> float | None:
        with self._lock:
            return self.hellos.get(wid)


def one_start(supervisor: Supervisor, relay: RelayStandIn, wid: str, role: str, template: bool) -> dict[str, Any]:
    argv = [sys.executable, "-m", f"rlctl.roles.{role}"]
    env = {"RLCTL_WORKLOAD": json.dumps({"device": "cpu", "model": {"path": ""}}), "RLCTL_STANDBY": "0"}
    asked = time.monotonic()
    record, _ = supervisor.start(wid, f"{role}-0", role, argv, env, cwd=None, template=template)
    started_s = time.monotonic() - asked
    deadline = asked + TIMEOUT_S
    exit_, ready = None, None
    while exit_ is None and time.monotonic() < deadline:
        if ready is None and MODEL_ERROR in record.log_path.read_bytes()[record.log_start:]:
            ready = time.monotonic()
        exit_ = next((e for e in supervisor.poll() if e.wid == wid), None)
        supervisor.maintain_templates(time.monotonic())
        time.sleep(0.005)
    hello = relay.hello_at(wid)
    if exit_ is None or hello is None or ready is None:
        raise SystemExit(f"{wid}: it did not say hello, stop at its model load and exit within {TIMEOUT_S} s: "
                         f"{exit_}; see {record.log_path}")
    return {"forked": record.forked, "start_call_s": round(started_s, 4), "hello_s": round(hello - asked, 3),
            "ready_s": round(ready - asked, 3)}


def wait_template_ready(supervisor: Supervisor) -> float:
    began = time.monotonic()
    while not any(t.state == "ready" for t in supervisor.templates.templates):
        if time.monotonic() - began > TIMEOUT_S:
            raise SystemExit("the worker template did not become ready")
        supervisor.maintain_templates(time.monotonic())
        time.sleep(0.05)
    return time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=4, help="starts per role and mode (the first is not counted)")
    args = parser.parse_args()
    if args.starts < 2:
        parser.error("--starts must be at least 2")
    results: dict[str, Any] = {"starts": args.starts, "cpus": os.cpu_count(), "roles": {}}
    with tempfile.TemporaryDirectory(prefix="rlws-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        config = AgentConfig(job_id="bench", node="node0", controller_host="127.0.0.1", controller_port=1,
                             workdir=workdir, gpu_provider="none")
        supervisor = Supervisor(config)
        relay = RelayStandIn(config.socket_path)
        template_import_s = None
        for mode in ("spawn", "template"):
            for role in ROLES:
                runs = []
                for index in range(args.starts):
                    run = one_start(supervisor, relay, f"{mode}-{role}-{index}", role, template=mode == "template")
                    print(f"{mode:8s} {role:8s} #{index}: {run}", file=sys.stderr, flush=True)
                    runs.append(run)
                    if mode == "template" and template_import_s is None:
                        template_import_s = round(wait_template_ready(supervisor), 2)
                counted = runs[1:]
                entry = results["roles"].setdefault(role, {})
                entry[mode] = {
                    "hello_s_median": round(statistics.median(r["hello_s"] for r in counted), 3),
                    "hello_s_max": max(r["hello_s"] for r in counted),
                    "ready_s_median": round(statistics.median(r["ready_s"] for r in counted), 3),
                    "forked": sum(r["forked"] for r in counted), "counted": len(counted),
                }
        supervisor.templates.close(for_good=True)
    results["template_ready_after_s"] = template_import_s
    for role, entry in results["roles"].items():
        entry["ready_speedup"] = round(entry["spawn"]["ready_s_median"] / entry["template"]["ready_s_median"], 1)
        entry["template_under_1s"] = entry["template"]["ready_s_median"] <= 1.0 and entry["template"]["forked"] == \
            entry["template"]["counted"]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
