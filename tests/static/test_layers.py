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


OWN_TOPS = ("rlctl", "rlctl_agent", "tests")


def module_name(path: Path) -> str:
    """The dotted name ``path`` is imported as (``agents/rlctl_agent/x.py`` is ``rlctl_agent.x``)."""
    relative = path.relative_to(ROOT / "agents" if path.is_relative_to(ROOT / "agents") else ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = ROOT / "agents" if name.startswith("rlctl_agent") else ROOT
    where = base.joinpath(*name.split("."))
    return where.is_dir() or where.with_suffix(".py").is_file()


def own_imports(path: Path, package: str | None = None) -> set[str]:
    """The modules of rlctl, rlctl_agent and tests that ``path`` imports, anywhere in it
    (TYPE_CHECKING and function bodies included), relative imports resolved; ``from P import m``
    counts the submodule ``P.m`` where ``m`` is one. ``package``: the one relative imports start
    from (by default ``path``'s own)."""
    found: set[str] = set()
    if package is None:
        inside = path.is_relative_to(ROOT)
        package = "" if not inside else module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names if _is_module(f"{module}.{alias.name}"))
    return {m for m in found if m.split(".")[0] in OWN_TOPS and m != "rlctl"}


def rule_for(path: Path, rules: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    relative = path.relative_to(ROOT).as_posix()
    best = max((where for where in rules if relative == where or relative.startswith(where + "/")), key=len, default=None)
    return None if best is None else rules[best]


def mapped_files() -> list[Path]:
    """Every file the layer map covers: the package, the agent and the benches."""
    return sorted([*(ROOT / "rlctl").rglob("*.py"), *(ROOT / "agents" / "rlctl_agent").rglob("*.py"),
                   *(ROOT / "bench").glob("*.py")])


def allowed_by(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allowed)


def test_every_module_imports_only_what_the_layer_map_allows() -> None:
    rules = import_rules()
    broken, unmapped = [], []
    for path in mapped_files():
        if path == ROOT / "rlctl" / "__init__.py":
            continue
        allowed = rule_for(path, rules)
        if allowed is None:
            unmapped.append(path.relative_to(ROOT).as_posix())
            continue
        for module in own_imports(path):
            if not allowed_by(module, allowed):
                broken.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not unmapped, f"not in the layer map of {RULES_DOC.name}: {unmapped}"
    assert not broken, broken


def never_reaches() -> dict[str, tuple[str, ...]]:
    """The table between ``<!-- never-reaches -->`` markers: what a folder's modules must not reach
    through any chain of imports."""
    text = RULES_DOC.read_text()
    table = text.split("<!-- never-reaches -->", 1)[1].split("<!-- /never-reaches -->", 1)[0]
    return {where.strip("`"): tuple(a.strip().strip("`") for a in banned.split(",") if a.strip())
            for where, banned in (line.strip().strip("|").split("|") for line in table.strip().splitlines()[2:])}


def import_graph() -> dict[str, set[str]]:
    """Module → the own modules it imports (a package's import runs its ``__init__`` too)."""
    graph: dict[str, set[str]] = {}
    for path in mapped_files():
        graph[module_name(path)] = own_imports(path)
    for module, imported in graph.items():
        for name in list(imported):
            parts = name.split(".")
            imported.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in graph)
        parent = module.rpartition(".")[0]
        if parent in graph:
            imported.add(parent)
    return graph


def chain_to(graph: dict[str, set[str]], start: str, banned: tuple[str, ...]) -> list[str] | None:
    """The shortest chain of imports from ``start`` to a module ``banned`` names, if there is one."""
    came_from: dict[str, str] = {start: ""}
    queue = [start]
    while queue:
        module = queue.pop(0)
        if module != start and allowed_by(module, banned):
            chain = [module]
            while came_from[chain[-1]]:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph.get(module, ())):
            if nxt not in came_from:
                came_from[nxt] = module
                queue.append(nxt)
    return None


def test_no_chain_of_imports_reaches_what_a_layer_must_never_reach() -> None:
    graph = import_graph()
    found = []
    for where, banned in never_reaches().items():
        prefix = where.replace("/", ".").removesuffix(".py").removeprefix("agents.")
        for module in sorted(m for m in graph if m == prefix or m.startswith(prefix + ".")):
            chain = chain_to(graph, module, banned)
            if chain is not None:
                found.append(" -> ".join(chain))
    assert not found, found


def test_a_chain_through_a_module_the_map_allows_is_seen(tmp_path: Path) -> None:
    graph = {"rlctl.controller.x": {"rlctl.assembly"}, "rlctl.assembly": {"rlctl.workload.seam"},
             "rlctl.workload.seam": set()}
    assert chain_to(graph, "rlctl.controller.x", ("rlctl.workload",)) == [
        "rlctl.controller.x", "rlctl.assembly", "rlctl.workload.seam"]
    assert chain_to(graph, "rlctl.assembly", ("rlctl.controller",)) is None
    relative = tmp_path / "rel.py"
    relative.write_text("from . import x\nfrom ..controller import server\n")
    assert "rlctl.controller.server" in own_imports(relative, package="rlctl.sim")


def test_the_rule_table_is_read_and_a_broken_rule_is_seen(tmp_path: Path) -> None:
    rules = import_rules()
    assert rules["rlctl/core"] == ("rlctl.core",) and "rlctl.workload" not in rules["rlctl/controller"]
    bad = ROOT / "rlctl" / "core" / "spec.py"
    assert rule_for(bad, rules) == ("rlctl.core",)
    leaking = tmp_path / "leak.py"
    leaking.write_text("from rlctl.controller.server import Controller\nfrom rlctl import sim\n")
    assert own_imports(leaking) == {"rlctl.controller.server", "rlctl.sim"}


def test_a_lab_job_gets_the_labs_fault_injector_and_others_none(tmp_path: Path) -> None:
    from rlctl.assembly import lab_fault_injector

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
