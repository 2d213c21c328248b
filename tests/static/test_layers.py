"""Import rules between the layers that hold today (read from the source, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (folder, module prefix it must not import): the core stays pure, the production backends know
# nothing of the lab (its fault injector is handed to them by rlctl.jobfile), and the controller
# reaches the workload only through the seam it is given (rlctl.controller.seam).
FORBIDDEN = [("rlctl/core", "rlctl.controller"), ("rlctl/core", "rlctl.backends"), ("rlctl/core", "rlctl.workload"),
             ("rlctl/backends", "rlctl.lab"), ("rlctl/controller", "rlctl.workload")]


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_layers_import_only_what_they_may() -> None:
    broken = []
    for folder, banned in FORBIDDEN:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in imported_modules(path):
                if module == banned or module.startswith(banned + "."):
                    broken.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not broken, broken


def test_a_lab_job_gets_the_labs_fault_injector_and_others_none(tmp_path: Path) -> None:
    from rlctl.jobfile import lab_fault_injector

    injector = lab_fault_injector({"lab_dir": str(tmp_path)})
    assert injector is not None and injector.supported_faults == frozenset({"partition", "node-down", "slow-link"})
    assert lab_fault_injector({"lab_dir": ""}) is None and lab_fault_injector({}) is None


class RecordingInjector:
    supported_faults = frozenset({"partition"})

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, object]]] = []
        self.closed = False

    async def inject(self, node: str, kind: str, params: dict[str, object]) -> bool:
        self.calls.append((node, kind, params))
        return kind in self.supported_faults

    async def close(self) -> None:
        self.closed = True


def test_backends_carry_out_faults_through_the_injector_they_are_given(tmp_path: Path) -> None:
    import asyncio

    from rlctl.backends.base import NodeInfo
    from rlctl.backends.slurm import SlurmBackend

    injector = RecordingInjector()
    backend = SlurmBackend(job_dir=tmp_path, fault_injector=injector)
    assert backend.supported_faults == frozenset({"partition"})
    node = NodeInfo("node03", "lab-n3")
    assert asyncio.run(backend.inject(node, "partition", {"duration": 2})) is True
    assert asyncio.run(backend.inject(node, "unknown", {})) is False
    asyncio.run(backend.close())
    assert injector.calls[0] == ("node03", "partition", {"duration": 2}) and injector.closed
    assert not asyncio.run(SlurmBackend(job_dir=tmp_path / "plain").inject(node, "partition", {}))
