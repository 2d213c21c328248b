"""Import rules between the layers that hold today (read from the source, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES_DOC = ROOT / "docs" / "architecture.md"


def import_rules() -> dict[str, tuple[str, ...]]:
    """The table between ``<!-- import-rules -->`` markers in docs/architecture.md: for each folder or
    file, the prefixes of rlctl's own modules it may import."""
    text = RULES_DOC.read_text()
    table = text.split("<!-- import-rules -->", 1)[1].split("<!-- /import-rules -->", 1)[0]
    rules: dict[str, tuple[str, ...]] = {}
    for line in table.strip().splitlines()[2:]:
        where, allowed = (cell.strip() for cell in line.strip().strip("|").split("|"))
        rules[where.strip("`")] = tuple(a.strip().strip("`") for a in allowed.split(",") if a.strip())
    return rules


def own_imports(path: Path) -> set[str]:
    """The rlctl (and rlctl_agent) modules ``path`` imports, anywhere in it (TYPE_CHECKING included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "rlctl":
                found.update(f"rlctl.{alias.name}" for alias in node.names
                             if (ROOT / "rlctl" / alias.name).is_dir() or (ROOT / "rlctl" / f"{alias.name}.py").is_file())
            else:
                found.add(node.module)
    return {m for m in found if m.split(".")[0] in ("rlctl", "rlctl_agent") and m != "rlctl"}


def rule_for(path: Path, rules: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    relative = path.relative_to(ROOT).as_posix()
    best = max((where for where in rules if relative == where or relative.startswith(where + "/")), key=len, default=None)
    return None if best is None else rules[best]


def test_every_module_imports_only_what_the_layer_map_allows() -> None:
    rules = import_rules()
    broken, unmapped = [], []
    for path in sorted([*(ROOT / "rlctl").rglob("*.py"), *(ROOT / "agents" / "rlctl_agent").rglob("*.py")]):
        if path == ROOT / "rlctl" / "__init__.py":
            continue
        allowed = rule_for(path, rules)
        if allowed is None:
            unmapped.append(path.relative_to(ROOT).as_posix())
            continue
        for module in own_imports(path):
            if not any(module == prefix or module.startswith(prefix + ".") for prefix in allowed):
                broken.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not unmapped, f"not in the layer map of {RULES_DOC.name}: {unmapped}"
    assert not broken, broken


def test_the_rule_table_is_read_and_a_broken_rule_is_seen(tmp_path: Path) -> None:
    rules = import_rules()
    assert rules["rlctl/core"] == ("rlctl.core",) and "rlctl.workload" not in rules["rlctl/controller"]
    bad = ROOT / "rlctl" / "core" / "spec.py"
    assert rule_for(bad, rules) == ("rlctl.core",)
    leaking = tmp_path / "leak.py"
    leaking.write_text("from rlctl.controller.server import Controller\nfrom rlctl import sim\n")
    assert own_imports(leaking) == {"rlctl.controller.server", "rlctl.sim"}


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
