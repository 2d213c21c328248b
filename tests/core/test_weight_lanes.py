"""Weight-sync lanes in the job model: pulls counted by lane (the ``lane`` label of the weight-sync
series), and the once-per-job warning that a pull could have taken a faster lane, decided in the
core and journaled by the controller's ``weights.held`` op (a resumed controller does not repeat it)."""

from __future__ import annotations

from types import SimpleNamespace

from rlctl.controller.ops import DataOps
from rlctl.core.event_payloads import WeightsHeldData
from rlctl.core.events import EventKind, event
from rlctl.core.model import JobModel
from rlctl.core.orchestrate import Orchestrator
from rlctl.core.spec import EnvSpec
from rlctl.core.telemetry import ControllerHealth, families
from tests.core.shells import RecordingShell
from tests.core.test_policy import running_job
from tests.core.test_rounds import make_scheduler

TCP_PULL = {"bytes": 4_000_000, "seconds": 2.0, "holders": 1, "lane": "tcp", "lanes": ["tcp/lo"], "gbps": 0.002,
            "same_node": True, "path": "ucx-sm", "faster_lane": "sm"}
SM_PULL = {"bytes": 1_000_000, "seconds": 0.5, "holders": 2, "lane": "sm", "lanes": ["cma/memory", "sysv/memory"],
           "gbps": 0.01, "same_node": True, "path": "ucx-sm"}


def _ops(model: JobModel) -> DataOps:
    spec = SimpleNamespace(env=EnvSpec(), multi_turn=False, colocated=False, reward={"on_error": "zero", "helper_backlog": 0},
                           fault_tolerance=SimpleNamespace(min_silence_s=3.0, stall_s=0.0))
    return DataOps(Orchestrator(spec, model, make_scheduler(tail=False), None, RecordingShell(model)),  # type: ignore[arg-type]
                   lambda now: None)


def _series(model: JobModel, name: str) -> dict[str, float]:
    family = next(f for f in families(model, 10.0, ControllerHealth(stall_after_s=0.5)) if f.name == name)
    return {labels["lane"]: value for labels, value in family.samples}


def test_pulls_are_counted_by_lane_and_a_slower_lane_is_warned_about_once_per_job() -> None:
    model = running_job()
    ops = _ops(model)
    model.apply(event(EventKind.WEIGHTS_PUBLISHED, 2.0, version=1, slot="trainer-0", source={"port": 1}))
    rollout_0, rollout_1 = model.slots["rollout-0"], model.slots["rollout-1"]
    ops.op_weights_held(rollout_0, {"version": 1, "source": {"port": 2}, **TCP_PULL}, 3.0)
    ops.op_weights_held(rollout_1, {"version": 1, "source": {"port": 3}, **TCP_PULL, "lane": "not a lane!"}, 3.5)
    ops.op_weights_held(rollout_1, {"version": 1, "source": {"port": 3}, **SM_PULL}, 4.0)
    journal = ops.orc.shell.journal  # type: ignore[attr-defined]
    warnings = [e for e in journal if e.type == EventKind.WEIGHTS_SLOWER_LANE]
    assert len(warnings) == 1 and model.slower_lane_warned
    warning = warnings[0].data
    assert (warning["slot"], warning["lane"], warning["faster_lane"], warning["same_node"]) == ("rollout-0", "tcp", "sm", True)
    assert "on one node went over tcp" in warning["reason"] and "shared memory is faster ([weights] shared_memory = true" in warning["reason"]
    held = [e.data for e in journal if e.type == EventKind.WEIGHTS_HELD]
    assert held[0]["lanes"] == ["tcp/lo"] and held[0]["path"] == "ucx-sm" and held[1]["lane"] == "other"
    assert _series(model, "rlctl_weight_sync_bytes_total") == {"tcp": 4e6, "other": 4e6, "sm": 1e6}
    assert _series(model, "rlctl_weight_syncs_total") == {"tcp": 1, "other": 1, "sm": 1}
    assert _series(model, "rlctl_weight_sync_seconds_total")["sm"] == 0.5

    resumed = running_job()  # a controller resumed from the journal has warned already
    for ev in journal:
        resumed.apply(ev)
    assert resumed.slower_lane_warned and resumed.weight_sync_lanes["tcp"].pulls == 1
    assert resumed.slower_lane_warning(WeightsHeldData(version=2, slot="rollout-0", source={}, **TCP_PULL), 9.0) is None


def test_a_pull_without_a_lane_counts_as_unknown_and_a_publish_counts_nothing() -> None:
    model = running_job()
    model.apply(event(EventKind.WEIGHTS_HELD, 3.0, version=0, slot="rollout-0", source={}, bytes=10, seconds=1.0))
    model.apply(event(EventKind.WEIGHTS_HELD, 4.0, version=0, slot="rollout-1", source={}))
    assert {lane: t.pulls for lane, t in model.weight_sync_lanes.items()} == {"unknown": 1}
    sm_pull = WeightsHeldData(version=0, slot="rollout-0", source={}, **SM_PULL)
    assert model.slower_lane_warning(sm_pull, 5.0) is None  # sm: nothing faster
