"""`rlctl model curve`: the torch engine measured at two degrees on a real (tiny) HF checkpoint,
the points fitted, the regroup timed as the rollout pays it, and the file in the form a job's
``[rollout.elastic] curve`` reads (``curve_from_json``); bad options are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlctl.core.elastic import curve_from_json
from tests.hf_models import tiny_model


def rlctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlctl.cli", *args], check=False, capture_output=True, text=True, timeout=300)


def test_the_curve_is_measured_fitted_and_accepted_by_a_job(tmp_path: Path) -> None:
    out = tmp_path / "curve.json"
    done = rlctl("model", "curve", str(tiny_model()), "--out", str(out), "--batches", "1,4", "--tokens", "8", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert json.loads(done.stdout)["points"] == document["points"]
    assert {(p["tensor_parallel"], p["batch"]) for p in document["points"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(p["step_s"] > 0 for p in document["points"]) and document["regroup_s"] > 0
    assert len(document["regroups_s"]) >= 4
    assert set(curve_from_json(document).lines) == {1, 2}

    bad = rlctl("model", "curve", str(tiny_model()), "--out", str(out), "--degrees", "1,x")
    assert bad.returncode == 2 and "--degrees: expected positive integers" in bad.stderr + bad.stdout
