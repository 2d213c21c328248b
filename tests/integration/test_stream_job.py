"""Stream-based training on a real local job: the trainer trains a step's first groups before the
round's batch is formed (the trainer counts those parts in each step's metrics); a trainer crashed in the middle of the job
is recovered and every step is still trained exactly once; the job succeeds. Two FSDP ranks, each
asking for its parts itself; one rank streams through every role's crash in the fault-kinds chaos
test's stream variant. The exactness of the streamed step is tests/workload/test_stream.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlctl.controller.jobdir import JobDir
from rlctl.controller.store import Journal
from tests.integration.helpers import kill_everything_under, rlctl_json, slow_reward_table, status, wait_for, write_job

STEPS = 6
pytestmark = pytest.mark.timeout(600)


@pytest.fixture()
def state_dir(tmp_path: Path):
    yield tmp_path / "jobs"
    kill_everything_under(tmp_path)


def test_a_streamed_job_of_two_ranks_trains_groups_before_the_batch_forms(tmp_path: Path, state_dir: Path) -> None:
    # Each rank asks for its parts itself; the parts are the same without a collective. A verifier
    # of 50 ms a sample spreads the groups' completion, so the first part is ready early.
    job_file = write_job(tmp_path, name="stream", steps=STEPS, spares=0, gpus_per_node=2,
                         extra_tables="\n[trainer]\nstream = true\nstream_parts = 2\n" + slow_reward_table(tmp_path))
    launched = rlctl_json(state_dir, "launch", str(job_file))
    job, jobdir = launched["job_id"], JobDir(Path(launched["job_dir"]))
    snap = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["step"] >= 2 and s, 240, "two streamed steps")
    trainer_node = next(n["name"] for n in snap["nodes"] if n["role"] == "trainer")
    fault = rlctl_json(state_dir, "inject-fault", trainer_node, "--job", job, "--kind", "crash")
    done = wait_for(lambda: (s := status(state_dir, job)) and s["job"]["state"] in ("succeeded", "failed") and s,
                    400, "the streamed job to finish")
    assert done["job"]["state"] == "succeeded", done["job"]
    recovered = {f["fault_id"]: f for f in done["faults"]}[fault["fault_id"]]
    assert recovered["recovered_at"] and recovered["slot"].startswith("trainer"), recovered
    events = list(Journal(jobdir.journal, readonly=True).read())
    trained = [e.data["step"] for e in events if e.type == "StepTrained"]
    assert trained == list(range(STEPS))
    early = [e.data["metrics"]["stream_parts_before_batch"] for e in events if e.type == "StepTrained"]
    assert sum(early) >= 1, f"no part was trained before its batch formed: {early}"
