"""The status snapshot of the model: what `rlctl status --json` and the live view read."""

from __future__ import annotations

from rlctl.core.events import event
from rlctl.core.snapshot import snapshot
from tests.core.test_policy import running_job


def test_a_released_node_has_no_heartbeat_age_or_phase_in_the_status() -> None:
    model = running_job()
    for node in ("node01", "node02"):
        model.apply(event("Heartbeat", 5.0, node=node))
    for state in ("failed", "released"):
        model.apply(event("NodeStateChanged", 6.0, node="node02", state=state, reason="job ended"))
    rows = {n["name"]: n for n in snapshot(model, 20.0)["nodes"]}
    assert rows["node02"]["state"] == "released"
    assert rows["node02"]["heartbeat_age_s"] is None and rows["node02"]["phase"] is None
    assert rows["node01"]["heartbeat_age_s"] == 15.0 and rows["node01"]["phase"] is not None
