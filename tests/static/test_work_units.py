"""How the suite is split between two xdist workers (``tests/conftest.py``): every test folder is
placed on purpose, and whole jobs never leave the one timed unit."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import MODULE_FOLDERS, TIMED_FOLDERS, TIMED_UNIT, work_unit_of

TESTS = Path(__file__).resolve().parents[1]


def test_every_folder_of_tests_is_either_timed_or_split_by_module() -> None:
    folders = {path.parent.relative_to(TESTS).parts[0] for path in TESTS.rglob("test_*.py")}
    assert not TIMED_FOLDERS & MODULE_FOLDERS
    unplaced = folders - TIMED_FOLDERS - MODULE_FOLDERS
    assert not unplaced, f"place {sorted(unplaced)} in TIMED_FOLDERS or MODULE_FOLDERS of tests/conftest.py"


def test_timed_tests_share_one_unit_and_the_others_go_by_module() -> None:
    assert work_unit_of("tests/chaos/test_fault_kinds.py::test_fault_kinds[stream]") == TIMED_UNIT
    assert work_unit_of("tests/gpu/test_gpucheck.py::test_the_local_job_part") == TIMED_UNIT
    assert work_unit_of("tests/weights/test_device_pull.py::test_a_joiner_pulls") == "tests/weights/test_device_pull.py"
    assert work_unit_of("tests/integration/test_local_job.py::test_launch_status_kill_resume_stop") == TIMED_UNIT
    assert work_unit_of("tests/core/test_policy.py::test_x[a::b]") == "tests/core/test_policy.py"
    assert work_unit_of("tests/sim/test_bursts.py") == "tests/sim/test_bursts.py"
    assert work_unit_of("tests/weights_procs_like.py::test_y") == "tests/weights_procs_like.py"  # a top-level module
