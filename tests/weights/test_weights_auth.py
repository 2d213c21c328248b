"""A weight holder serves only pulls that carry its job's token, on every transport, and a job's
holder never binds every interface."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.weights.server import WeightServer

HAS_UCXX = importlib.util.find_spec("ucxx") is not None
ROOT = Path(__file__).resolve().parents[2]


def test_a_pull_without_the_job_token_is_refused_on_every_transport() -> None:
    transports = ["tcp", *(["ucx", "ucx-sm"] if HAS_UCXX else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm,cma",
           "UCXPY_PROGRESS_MODE": "blocking", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    env.pop("RLCTL_WEIGHTS_TOKEN", None)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("auth_check.py")), *transports], check=False,
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["transport"] for r in results] == transports
    for result in results:
        assert result["without"].startswith("refused"), result
        assert result["wrong"].startswith("refused"), result
        assert result["with"] == "ok v3 sum 1000.0", result


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_weight_server_refuses_to_bind_every_interface(host: str) -> None:
    with pytest.raises(ValueError, match="binds one address"):
        WeightServer("tcp", host=host)
