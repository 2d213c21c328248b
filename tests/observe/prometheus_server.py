"""A real Prometheus server for tests (Debian's `prometheus`, installed when root and missing),
on loopback, scraping the targets the test names every second; PromQL through its HTTP API."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def unavailable() -> str:
    """Why no Prometheus server can run here ("" when one can)."""
    if shutil.which("prometheus"):
        return ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "needs Debian's prometheus package (install it, or run as root to let the tests install it)"
    from rlctl.lab.packages import install_packages

    install_packages(["prometheus"])
    return "" if shutil.which("prometheus") else "installing Debian's prometheus package failed"


UNCLAIMED_PORTS = range(30000, 32768)  # below Linux's ephemeral range (32768-60999) and the trainers' 20000-29999


def free_port() -> int:
    """A loopback port free now, for a server started later by another process. It is drawn below
    the ephemeral range: a port from ``bind(0)`` may be handed to any outgoing connection on the
    machine before the server binds it (EADDRINUSE); one from here only to another explicit bind."""
    while True:
        port = random.SystemRandom().choice(UNCLAIMED_PORTS)  # not the global generator: tests seed it
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@contextmanager
def prometheus_server(workdir: Path, targets: list[str]) -> Iterator[str]:
    """Start Prometheus scraping ``targets`` (host:port) every second; yields its base URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "rlctl", "static_configs": [{"targets": targets}]}],
    }))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """The instant vector of ``promql`` now: [{"metric": labels, "value": float}]."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return [{"metric": r["metric"], "value": float(r["value"][1])} for r in body["data"]["result"]]
