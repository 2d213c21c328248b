"""rlctl's discrete-event simulator: the pure core under a virtual clock and a cost model.

See docs/sim.md. Entry points: ``Simulation`` (one run), ``engine.simulate`` /
``engine.compare_policies``, ``calibrate.predict_from_journal``; the CLI is ``rlctl sim``.
"""

from rlctl.sim.calibrate import make_failure_model
from rlctl.sim.costmodel import CostModel, default_cost_model, load_cost_model
from rlctl.sim.engine import SimConfig, Simulation
from rlctl.sim.faults import GpuHourFailures, StepFailures, TraceFailures

__all__ = ["CostModel", "GpuHourFailures", "SimConfig", "Simulation", "StepFailures", "TraceFailures",
           "default_cost_model", "load_cost_model", "make_failure_model"]
