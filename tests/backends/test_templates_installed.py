"""The sbatch templates are found in a source checkout and in an installed wheel (which carries them
to ``<prefix>/share/rlctl/templates``), and a missing copy is a clear error."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlctl.backends.base import BackendError
from rlctl.backends.slurm_scripts import ROLE_TEMPLATE, TASK_TEMPLATE, find_template_dir, template_dir_candidates

ROOT = Path(__file__).resolve().parents[2]


def test_a_checkout_uses_its_templates_folder() -> None:
    assert find_template_dir() == ROOT / "templates"


def test_an_install_uses_the_shared_copy_and_a_missing_one_names_where_it_looked(tmp_path: Path) -> None:
    shared = tmp_path / "share" / "rlctl" / "templates"
    shared.mkdir(parents=True)
    for name in (ROLE_TEMPLATE, TASK_TEMPLATE):
        shutil.copy(ROOT / "templates" / name, shared / name)
    assert find_template_dir([tmp_path / "no-checkout", shared]) == shared
    (shared / TASK_TEMPLATE).unlink()
    with pytest.raises(BackendError, match="templates are missing.*no-checkout.*share/rlctl/templates"):
        find_template_dir([tmp_path / "no-checkout", shared])


@pytest.mark.timeout(300)
def test_the_wheel_installs_the_templates_where_an_install_looks(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77", reason="builds with this environment's setuptools")
    source = tmp_path / "source"  # a copy: building in place would leave build/ and egg-info in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("rlctl", "agents", "templates"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=240)
    wheel = next((tmp_path / "dist").glob("rlctl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    data = {n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n}
    installed = template_dir_candidates()[1].relative_to(sys.prefix)
    assert {str(installed / ROLE_TEMPLATE), str(installed / TASK_TEMPLATE)} <= data, data
