"""The job model's faults: injected, refused, seen (a verdict), recovered, and what they cost.

The first layer of the job model over its shared records (``model_base.JobRecords``): the event handlers for faults (``_on_FaultInjected``,
``_on_FaultAccepted``, ``_on_FaultRefused``, ``_on_FaultSignal``, ``_on_Verdict``,
``_on_FaultRecovered``), the rules that end a fault when its slot, node or the whole job is back,
and the share of the job's progress a fault takes away (the ETTR ledger's weights). A delayed
injection is no fault until it is carried out (``FaultScheduled`` and ``FaultCancelled`` change
nothing here); an injection counts in the ledger only once its agent or backend carried it out
(``FaultAccepted``) or a verdict saw it. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.core.event_kinds import EventKind
from rlctl.core.event_payloads import (
    FaultAcceptedData,
    FaultInjectedData,
    FaultRecoveredData,
    FaultRefusedData,
    FaultSignalData,
    VerdictData,
)
from rlctl.core.events import Event
from rlctl.core.faultparams import heals_at
from rlctl.core.model_base import JobRecords, handles
from rlctl.core.records import FaultRecord, SlotRecord
from rlctl.core.states import WorkerState

# Faults of one worker process (injected kinds): a restart of that process ends them.
PROCESS_FAULTS = frozenset({"crash", "hang", "slow", "nccl-timeout", "network"})
# A verdict whose plan replaces the worker (restarts it, or retires its node).
REPLACING_ACTIONS = frozenset({"restart-worker", "restart-role", "replace-node", "drain-replace"})


@dataclass
class FaultLedger(JobRecords):
    faults: dict[str, FaultRecord] = field(default_factory=dict)

    def healed_unseen(self, now: float) -> list[FaultRecord]:
        """Open injected faults that ended by themselves (their duration passed) before anyone saw them."""
        return [f for f in self.faults.values()
                if f.open and f.detected_at is None and f.heals_at is not None and f.heals_at <= now + 1e-9]

    def open_faults(self) -> list[FaultRecord]:
        return [f for f in self.faults.values() if f.open]

    def ettr_weights(self) -> dict[str, float]:
        """How the current instant is split between ETTR categories (sums to 1)."""
        if self.productive_since is None:
            return {"init": 1.0}
        # Faults of one worker process, or one node fault injected twice (twins, below), take the
        # job's progress away once.
        impacts: dict[tuple[str, str | None, bool], float] = {}
        for fault in self.open_faults():
            if fault.awaiting_answer:
                continue
            key = (fault.node, fault.slot if fault.kind in PROCESS_FAULTS else fault.kind, fault.detected_at is None)
            impacts[key] = max(impacts.get(key, 0.0), fault.impact)
        undetected = sum(impact for key, impact in impacts.items() if key[2])
        detected = sum(impact for key, impact in impacts.items() if not key[2])
        impaired = min(1.0, undetected + detected)
        if impaired <= 0:
            return {"productive": 1.0}
        share = impaired / (undetected + detected)
        weights = {"productive": 1.0 - impaired, "detection": undetected * share, "recovery": detected * share}
        return {k: v for k, v in weights.items() if v > 0} or {"productive": 1.0}

    def fault_impact(self, slot: SlotRecord | None) -> float:
        """Fraction of the job's progress a fault on this slot takes away."""
        if self.policy == "full-restart":
            return 1.0
        if slot is None or slot.standby:
            return 0.0
        if slot.role == "trainer":
            return 1.0
        peers = len(self.slots_of(slot.role))
        return 1.0 / max(peers, 1)

    @handles(EventKind.FAULT_INJECTED)
    def _on_FaultInjected(self, ev: Event) -> None:
        d = ev.as_(FaultInjectedData)
        aimed = str(d.params.get("worker") or "")  # a slot of the node or a worker id (``--worker``)
        slot = (self.slots.get(aimed) or self.slot_of_wid(aimed) or self.slot_on_node(d.node)
                or next(iter(self.slots_on_node(d.node)), None))
        occurred_at = ev.at + float(d.params.get("after", 0.0))
        self.faults[d.fault_id] = FaultRecord(
            fault_id=d.fault_id,
            kind=d.kind,
            node=d.node,
            slot=slot.slot if slot else None,
            occurred_at=occurred_at,
            injected=True,
            impact=self.fault_impact(slot),
            awaiting_answer=d.awaiting_answer,
            heals_at=heals_at(d.kind, d.params, occurred_at),
        )

    @handles(EventKind.FAULT_ACCEPTED)
    def _on_FaultAccepted(self, ev: Event) -> None:
        fault = self.faults.get(ev.as_(FaultAcceptedData).fault_id)
        if fault is not None:
            fault.awaiting_answer = False

    @handles(EventKind.FAULT_REFUSED)
    def _on_FaultRefused(self, ev: Event) -> None:
        refused = ev.as_(FaultRefusedData)
        fault = self.faults.get(refused.fault_id)
        if fault is not None:
            fault.refused = refused.reason or "refused"

    @handles(EventKind.FAULT_SIGNAL)
    def _on_FaultSignal(self, ev: Event) -> None:
        signal = ev.as_(FaultSignalData)
        node = self.nodes.get(signal.node)
        if node is not None:
            node.last_signal = f"{signal.kind}: {signal.detail}"[:120]

    @handles(EventKind.VERDICT)
    def _on_Verdict(self, ev: Event) -> None:
        d = ev.as_(VerdictData)
        if d.verdict not in ("failed", "slow"):
            return
        named = self.faults.get(d.fault)  # the open fault the verdict names, else the node's open fault
        fault = named if named is not None and named.open else self._open_fault_for(d.node, d.slot)
        slot = self.slots.get(d.slot) if d.slot else None
        explained = slot is not None and self._injected_into(slot)  # before this verdict sees the injection
        judged = d.fault_kind if d.fault_kind is not None else d.fault
        if fault is None:
            hit = slot if slot is not None else self.slot_on_node(d.node)
            # Never over a closed record of the same id (a refused injection): a new fault.
            fault_id = d.fault if d.fault not in self.faults else f"{d.fault}@{ev.seq or ev.at}"
            fault = FaultRecord(
                fault_id=fault_id,
                kind=judged,
                node=d.node,
                slot=hit.slot if hit else None,
                occurred_at=float(d.evidence_since if d.evidence_since is not None else ev.at),
                injected=False,
                impact=self.fault_impact(hit),
            )
            self.faults[fault.fault_id] = fault
        if fault.detected_at is None:
            twins = self._twins(fault, ev.at, replaced=d.verdict == "failed" and d.action in REPLACING_ACTIONS)
            for seen in (fault, *twins):
                seen.detected_at = ev.at
                seen.awaiting_answer = False  # seen, so it happened (its agent's answer may come later)
                seen.verdict = judged
                seen.reason = d.reason
                seen.action = d.action
            failed = self.slots.get(d.slot or "")
            if failed is not None and failed.slot != fault.slot:
                # The worker that failed: an injection's guess may have named its neighbour.
                for seen in (fault, *twins):
                    seen.slot, seen.impact = failed.slot, self.fault_impact(failed)
        if slot is not None and d.verdict == "failed" and slot.wid and d.wid == slot.wid and not explained:
            slot.count_failed_start(slot.wid, d.reason)
        if slot is not None and slot.life is not None and slot.life.can_move(WorkerState.FAILED):
            slot.life.move(WorkerState.FAILED, ev.at, d.reason[:80])

    @handles(EventKind.FAULT_RECOVERED)
    def _on_FaultRecovered(self, ev: Event) -> None:
        for fault_id in ev.as_(FaultRecoveredData).fault_ids:
            fault = self.faults.get(fault_id)
            if fault is not None and fault.recovered_at is None:
                self._recover_fault(fault, ev.at)

    def _seen_with_retired_node(self, node: str, at: float, reason: str) -> None:
        """A node taken out of the job: a fault on it that no verdict saw (another failure of the node,
        or one after the verdict that retires it) is seen now, and ends when the node's work is back."""
        for fault in self.open_faults():
            if fault.node == node and fault.detected_at is None:
                fault.detected_at, fault.verdict, fault.reason = at, "node-retired", reason[:200]
                fault.awaiting_answer = False

    def _injected_into(self, slot: SlotRecord) -> bool:
        """Whether an injected fault (an operator's chaos) that no verdict has seen yet is on ``slot``'s
        worker or node: the failure now reported is that injection, no sign that the slot cannot start.
        Once seen, an injection explains nothing more: the next worker's failure counts."""
        return any(fault.injected and fault.detected_at is None
                   and (fault.slot == slot.slot or (fault.node == slot.node and fault.kind not in PROCESS_FAULTS))
                   for fault in self.open_faults())

    def _seen_with_stopped_worker(self, slot: SlotRecord, at: float) -> None:
        """``slot``'s worker was stopped (a plan replaces it, or the job stops): a fault of that process
        that no verdict saw (a crash a moment before the stop came) is seen by its stop, and ends when
        the slot's next worker serves, as the fault the plan handles does."""
        for fault in self.open_faults():
            if (fault.slot == slot.slot and fault.kind in PROCESS_FAULTS and fault.detected_at is None
                    and fault.occurred_at <= at):
                fault.detected_at, fault.verdict = at, "replaced"
                fault.reason, fault.awaiting_answer = f"its worker {slot.wid} was stopped and replaced", False

    def _open_fault_for(self, node: str, slot: str | None) -> FaultRecord | None:
        for fault in self.open_faults():
            if fault.node == node and (slot is None or fault.slot in (None, slot)):
                return fault
        return None

    def _recover_slot(self, slot: SlotRecord, at: float) -> None:
        """``slot``'s worker has its role back: it serves, and the faults it was recovering from end."""
        slot.serving, slot.failed_starts = True, 0
        for fault in self.open_faults():
            if fault.slot == slot.slot and fault.detected_at is not None and self.policy == "role":
                self._recover_fault(fault, at)

    def _recover_after_full_restart(self, at: float) -> None:
        """Everything is back once the restarted trainer restored and a rollout holds its weights. That
        also ends a fault of a process nobody had noticed yet: the restart replaced that process."""
        for fault in self.open_faults():
            seen_and_restored = fault.detected_at is not None and self.trainer_restored_at >= fault.detected_at
            unseen_and_replaced = (fault.detected_at is None and fault.kind in PROCESS_FAULTS
                                   and fault.occurred_at <= self.full_stop_at <= self.trainer_restored_at)
            if seen_and_restored or unseen_and_replaced:
                self._recover_fault(fault, at)

    def _recover_matching(self, kind: str, node: str, slot: str | None, at: float) -> None:
        for fault in self.open_faults():
            if fault.node == node and fault.verdict == kind:
                self._recover_fault(fault, at)

    def _twins(self, fault: FaultRecord, seen_at: float, replaced: bool = False) -> list[FaultRecord]:
        """The same failure met again before ``fault`` was seen at ``seen_at``, unseen or seen with it:
        the same fault injected again (same kind and node and, for a process fault, worker slot)
        and, when the verdict's plan replaces the process (``replaced``), any other fault of that
        process. One verdict sees them all and one recovery ends them all; left open, a twin would
        count as an undetected fault, taking the job's time from ``productive``, to the end."""
        def same_failure(twin: FaultRecord) -> bool:
            if fault.kind in PROCESS_FAULTS and twin.kind in PROCESS_FAULTS:
                return twin.slot == fault.slot and (replaced or twin.kind == fault.kind)
            return twin.kind == fault.kind
        return [twin for twin in self.open_faults()
                if twin is not fault and twin.node == fault.node and same_failure(twin)
                and twin.occurred_at <= seen_at and twin.detected_at in (None, fault.detected_at)]

    def _recover_fault(self, fault: FaultRecord, at: float) -> None:
        if fault.detected_at is None:
            fault.detected_at = at
        for ended in (fault, *self._twins(fault, fault.detected_at)):
            ended.detected_at, ended.recovered_at = fault.detected_at, at
