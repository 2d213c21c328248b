"""The observability tests share the simulator tests' example job."""

from tests.sim.conftest import quickstart  # noqa: F401  (a fixture)
