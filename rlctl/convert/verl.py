"""`rlctl convert verl`: verl 0.9.1's main_ppo Hydra overrides in, an rlctl job file out.

Role: start from verl's defaults (``verl_defaults``, plus DAPO's keys), apply the overrides as
Hydra does, judge every override (``verl_rules.RULES``: mapped, ignored or refused, each with its
reason), derive every job key from the resolved config (``verl_rules.JOB_VALUES``), and render the
job file (``toml_writer``) only when nothing is refused and rlctl's own schema accepts it. A
refusal of a default no override touched (verl's ``adv_estimator`` is ``gae``) is listed after the
overrides' entries. Pure apart from ``Facts`` (the train files' rows, the model's config.json).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from typing import Any

from rlctl.convert import verl_defaults
from rlctl.convert.hydra import Override, OverrideError, parse_override
from rlctl.convert.toml_writer import render_toml
from rlctl.convert.verl_config import apply_overrides
from rlctl.convert.verl_rules import (
    IGNORED,
    JOB_VALUES,
    MAPPED,
    REFUSED,
    RULES,
    KeyContext,
    Verdict,
    default_refusals,
    judge,
    rule_for,
)
from rlctl.convert.verl_run import ConvertOptions, Facts, Refusal, Run
from rlctl.core.schema import Problem
from rlctl.core.spec import SpecError, parse_spec

__all__ = ["Conversion", "ConvertOptions", "KeyDecision", "OverrideError", "convert_verl"]


@dataclass(frozen=True)
class KeyDecision:
    """What became of one verl key: ``status`` is mapped (carried exactly; ``job_key`` names the
    rlctl key, or None where rlctl always does what the value says), ignored or refused."""

    verl: str
    value: Any
    status: str
    job_key: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"verl": self.verl, "value": self.value, "status": self.status, "job_key": self.job_key,
                "reason": self.reason}


@dataclass(frozen=True)
class Conversion:
    """The decisions (one per override, in order, then refused defaults) and the job file's text
    (None when anything is refused or the job does not validate)."""

    decisions: list[KeyDecision]
    job_text: str | None = None
    problems: list[str] = field(default_factory=list)  # rlctl's schema on the converted job
    notes: list[str] = field(default_factory=list)  # choices no override states (also in the file's header)

    @property
    def refused(self) -> list[KeyDecision]:
        return [d for d in self.decisions if d.status == REFUSED]

    @property
    def ok(self) -> bool:
        return self.job_text is not None


def convert_verl(args: list[str], options: ConvertOptions, facts: Facts, command_line: str = "") -> Conversion:
    """Convert verl overrides ``args``; raises OverrideError naming a malformed argument or a key
    Hydra would refuse."""
    overrides = [parse_override(arg) for arg in args]
    cfg = apply_overrides(overrides)
    run = Run(cfg, facts, options)
    last = {override.key: index for index, override in enumerate(overrides)}
    decisions = [_judge_override(override, run) if last[override.key] == index else _superseded(override)
                 for index, override in enumerate(overrides)]
    tables, comments, refusals = _job_tables(run)
    refusals += default_refusals(run, {o.key for o in overrides})
    decisions = _merge_refusals(decisions, refusals, run, set(last.values()))
    if any(d.status == REFUSED for d in decisions):
        return Conversion(decisions, notes=run.notes)
    text = render_toml(tables, comments, _header(command_line, run.notes))
    problems = _schema_problems(text, options)
    if not problems:
        return Conversion(decisions, text, notes=run.notes)
    refusals, unplaced = _problem_refusals(problems, set(last))
    decisions = _merge_refusals(decisions, refusals, run, set(last.values()))
    return Conversion(decisions, None, [p.render("job.toml") for p in unplaced], run.notes)


def _judge_override(override: Override, run: Run) -> KeyDecision:
    value = override.value if override.has_value else None
    if override.op == "delete":
        verdict = _judge_delete(override, run)
    else:
        verdict = judge(KeyContext(override.key, run.cfg[override.key], run, override))
    return KeyDecision(override.key, value, verdict.status, verdict.job_key, verdict.reason)


def _superseded(override: Override) -> KeyDecision:
    """An override of a key a later override sets again: the last one counts, as in Hydra."""
    return KeyDecision(override.key, override.value if override.has_value else None, IGNORED, None,
                       "a later override sets this key again; the last one counts")


def _judge_delete(override: Override, run: Run) -> Verdict:
    """A deleted key changes nothing only where every leaf it removes is one verl tunes itself with."""
    gone = sorted(k for k in run.cfg.deleted if k == override.key or k.startswith(override.key + "."))
    reasons = []
    for leaf in gone:
        rule = rule_for(leaf)
        if rule is None or rule.status != IGNORED or rule.refuse is not None or rule.decide is not None:
            return Verdict(REFUSED, f"deletes {leaf}, which decides what is learned: verl's code then falls back "
                           "on a default of its own, which this converter cannot know")
        reasons.append(rule.reason)
    return Verdict(IGNORED, f"deletes what only tunes verl: {reasons[0]}" if reasons else "deletes nothing")


def _job_tables(run: Run) -> tuple[dict[str, Any], dict[str, str], list[Refusal]]:
    """Every job key ``JOB_VALUES`` writes (nested tables), its comment, and the refusals met."""
    tables: dict[str, Any] = {}
    comments: dict[str, str] = {}
    refusals: list[Refusal] = []
    for job_value in JOB_VALUES:
        try:
            if not job_value.when(run):
                continue
            value = job_value.value(run)
        except Refusal as exc:
            refusals.append(exc)
            continue
        *path, name = job_value.job_key.split(".")
        node = tables
        for part in path:
            node = node.setdefault(part, {})
        node[name] = value
        if job_value.comment:
            comments[job_value.job_key] = job_value.comment
    return tables, comments, refusals


def _merge_refusals(decisions: list[KeyDecision], refusals: list[Refusal], run: Run,
                    final: set[int]) -> list[KeyDecision]:
    """Each refusal marks the (last) override of its key refused; one of a key no override set is
    added. ``final``: the indexes of each key's last override."""
    merged = list(decisions)
    added: dict[str, int] = {}
    for refusal in refusals:
        hits = [i for i, d in enumerate(merged) if d.verl == refusal.key and (i in final or i >= len(decisions))]
        for index in hits:
            decision = merged[index]
            if decision.status != REFUSED:
                merged[index] = KeyDecision(decision.verl, decision.value, REFUSED, None, refusal.reason)
            elif refusal.reason not in decision.reason:
                merged[index] = KeyDecision(decision.verl, decision.value, REFUSED, None,
                                            f"{decision.reason}; {refusal.reason}")
        if hits or refusal.key in added:
            continue
        added[refusal.key] = len(merged)
        origin = "verl's default" if not run.cfg.is_set(refusal.key) else "its value"
        merged.append(KeyDecision(refusal.key, run.cfg[refusal.key], REFUSED, None,
                                  f"not among the overrides ({origin}): {refusal.reason}"))
    return merged


def _header(command_line: str, notes: list[str]) -> list[str]:
    return [
        f"Converted from verl {verl_defaults.VERL_VERSION} main_ppo overrides by `rlctl convert verl`:",
        f"  {command_line}" if command_line else "  (no command line recorded)",
        "It starts from verl's defaults, so each value verl decides is written, its verl keys in the comment.",
        "Tail batching is off: verl trains synchronous batches. Turning it on is your choice (it changes",
        "which prompts form a batch). [spares] nodes = 1 is rlctl's spare node for fault tolerance.",
        *(f"Note: {note}" for note in notes),
    ]


def _schema_problems(text: str, options: ConvertOptions) -> list[Problem]:
    """rlctl's schema and cross-checks on the written text (an ssh inventory is the user's to fill)."""
    try:
        parse_spec(tomllib.loads(text), "job.toml")
    except SpecError as exc:
        return [p for p in exc.problems if not (options.backend == "ssh" and p.key.startswith("cluster.ssh"))]
    return []


def _problem_refusals(problems: list[Problem], overridden: set[str]) -> tuple[list[Refusal], list[Problem]]:
    """Each problem rlctl's schema finds, as a refusal of the verl keys the rule table maps to its
    job key (the first of them where none was overridden); the rest stay problems of the file."""
    refusals: list[Refusal] = []
    unplaced: list[Problem] = []
    for problem in problems:
        keys = [rule.pattern for rule in RULES if rule.concrete and rule.job_key
                and problem.key in rule.job_key.split(", ")]
        if not keys:
            unplaced.append(problem)
        keys = [key for key in keys if key in overridden] or keys[:1]
        refusals.extend(Refusal(key, f"rlctl's {problem.key}: {problem.message}") for key in keys)
    return refusals, unplaced


STATUSES = (MAPPED, IGNORED, REFUSED)
