"""Turn-taking on colocated nodes (``[roles.rollout] placement = "colocated"``). Pure.

A colocated node runs trainer ranks and generation engines on the same GPUs, so they must not
hold their working memory at the same time. The controller enforces the turns with two gates,
both answered from the slots' reported phases:

- a trainer rank takes its batch only once every engine on its node has released its memory
  (phase ``sleeping``) and holds no generation work, or is not running at all;
- an engine takes generation work only while no trainer rank on its node steps: one in phase
  ``training``, or one waiting for a batch that is already formed (it is about to train).

Each side frees memory before it waits: an engine sleeps as soon as it has no work, a trainer
offloads its optimizer state while it waits for a batch. The rounds already alternate (a round
uses the newest weights, which the trainer publishes after its step), so the gates only hold a
worker back for the moments where the two would overlap: an engine still finishing its last
chunk when the batch closes, a held-out evaluation while the trainer steps.
"""

from __future__ import annotations

from rlctl.core.model import JobModel, SlotRecord
from rlctl.core.rounds import RoundScheduler
from rlctl.core.states import WorkerState

# A colocated engine in these phases has released its memory: it sleeps (``idle`` is what vLLM
# reports as it goes to sleep), or scores for the reward role, which it does asleep.
ENGINE_RELEASED_PHASES = frozenset({"sleeping", "idle", "scoring"})
_RUNNING = (WorkerState.STARTING, WorkerState.RUNNING)


def _neighbours(model: JobModel, slot: SlotRecord, role: str) -> list[SlotRecord]:
    if slot.node is None:
        return []
    return [s for s in model.slots_on_node(slot.node) if s.role == role and not s.standby and s is not slot
            and s.wid and s.life is not None and s.life.state in _RUNNING]


def trainer_may_step(model: JobModel, scheduler: RoundScheduler, trainer: SlotRecord) -> bool:
    """Whether the trainer rank in ``trainer`` may start its step: every engine beside it sleeps
    and holds no generation work."""
    return all(s.phase in ENGINE_RELEASED_PHASES and not scheduler.work_held_by(s.wid or "", "inflight")[1]
               for s in _neighbours(model, trainer, "rollout"))


def engine_may_generate(model: JobModel, scheduler: RoundScheduler, engine: SlotRecord) -> bool:
    """Whether the engine in ``engine`` may take generation work: no trainer rank beside it
    trains or waits for a batch that is formed."""
    return not any(s.phase == "training" or (s.phase == "waiting-for-batch" and scheduler.batch_for(s.phase_step) is not None)
                   for s in _neighbours(model, engine, "trainer"))
