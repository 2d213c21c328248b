"""The seam between the controller and the workload: the job's prompts, and the launch's checks.

Role: the controller owns prompts (it journals which ones each round took, so no fault or
resume repeats or skips one) but knows nothing of tokenizers or data files; it calls
``load_prompts(spec)`` and gets ``PromptRef``s: token ids plus the metadata the reward needs.
``preflight(spec)`` is what ``rlctl launch`` (and ``--dry-run``) checks before anything starts:
the model folder, every data row, the reward function's import.

Two sources, chosen by the spec, both tokenized with the job's model folder's tokenizer and chat
template (``[model] path``, or the reference model's folder, rlctl.workload.reference):

- ``[data] train_files``: the user's rows (verl layout); prompt ids are ``d<n>`` in
  file-then-row order;
- no data files: the reference task's prompts as chat messages, scored by the ``task`` scorer
  (data source ``rlctl/task/<family>``).

Torch-free (tokenizers, jinja2, pyarrow only), and deterministic: a resumed controller
rebuilds the same prompts with the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.core.rounds import PromptRef
from rlctl.core.sizing import ModelShape, SizingError, plan_sizes
from rlctl.core.spec import JobSpec
from rlctl.workload.datafiles import Columns, DataError, Record, read_records
from rlctl.workload.modeldir import ModelDirError, check_model_dir
from rlctl.workload.rewardfn import RewardFunctionError, RewardSpec, load_function

TASK_DATA_SOURCE = "rlctl/task"


class PreflightError(ValueError):
    """What ``rlctl launch`` refuses to start with; one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class PromptSet:
    """The job's prompts, and how many rows were longer than ``max_prompt_tokens``: left out, or
    truncated (``truncated``), as ``[data] filter_overlong_prompts`` and ``truncation`` say."""

    prompts: list[PromptRef]
    too_long: int
    source: str
    truncated: int = 0


TRUNCATIONS = ("error", "left", "right", "middle")


def truncate_prompt(tokens: list[int], limit: int, truncation: str) -> list[int]:
    """verl's ``data.truncation`` of an over-long prompt: ``left`` keeps its last ``limit`` tokens,
    ``right`` its first, ``middle`` both ends (the first half rounded down)."""
    if len(tokens) <= limit:
        return tokens
    if truncation == "left":
        return tokens[-limit:]
    if truncation == "right":
        return tokens[:limit]
    if truncation == "middle":
        head = limit // 2
        return tokens[:head] + tokens[len(tokens) - (limit - head):]
    raise ValueError(f"unknown truncation {truncation!r}: expected one of {', '.join(TRUNCATIONS)}")


def task_records(spec: JobSpec) -> list[Record]:
    """The reference task's prompts as chat rows (for an HF model without data files)."""
    return task_record_rows(spec.rollout.dataset_size, spec.seed)


def task_record_rows(count: int, seed: int, **dataset_args: Any) -> list[Record]:
    """``task.make_dataset(count, seed, **dataset_args)`` as chat rows scored by the ``task`` scorer."""
    from rlctl.workload.task import make_dataset

    return [Record(file="(reference task)", row=index, prompt=[{"role": "user", "content": str(p.meta["question"])}],
                   ground_truth=str(p.meta["answer"]), data_source=f"{TASK_DATA_SOURCE}/{p.meta['family']}",
                   extra_info={"family": p.meta["family"], "expected_len": p.meta["expected_len"]})
            for index, p in enumerate(make_dataset(count, seed, **dataset_args))]


def _records(spec: JobSpec, files_key: str = "train_files") -> list[Record]:
    data = spec.data
    if data[files_key]:
        return read_records(data[files_key], Columns.from_table(data))
    return task_records(spec)


def tokenize_records(records: list[Record], model_dir: str | Path, max_prompt_tokens: int,
                     id_prefix: str = "d", filter_overlong: bool = True, truncation: str = "error") -> PromptSet:
    """Each record's prompt through the chat template. One longer than ``max_prompt_tokens`` is left
    out (``filter_overlong``), truncated (``truncation`` left/right/middle), or refused: a
    ``DataError`` naming the first such rows (``truncation = "error"``, as verl raises)."""
    from rlctl.workload.hf_tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(model_dir)
    prompts: list[PromptRef] = []
    too_long: list[Record] = []
    for index, record in enumerate(records):
        try:
            tokens = tokenizer.encode_prompt(record.prompt)
        except ValueError as exc:
            raise DataError(f"{record.file}: row {record.row}: the prompt cannot be tokenized: {exc}") from None
        if len(tokens) > max_prompt_tokens:
            too_long.append(record)
            if filter_overlong or truncation == "error":
                continue
            tokens = truncate_prompt(tokens, max_prompt_tokens, truncation)
        prompts.append(PromptRef(f"{id_prefix}{index}", tuple(tokens), reward_meta(record)))
    if too_long and not filter_overlong and truncation == "error":
        rows = ", ".join(f"{r.file}: row {r.row}" for r in too_long[:3])
        raise DataError(f"{len(too_long)} prompts are longer than model.max_prompt_tokens = {max_prompt_tokens} "
                        f"({rows}{', ...' if len(too_long) > 3 else ''}) and data.truncation is \"error\" "
                        "(data.filter_overlong_prompts = false): set one of them to leave them out or cut them")
    kept_long = 0 if filter_overlong else len(too_long)
    return PromptSet(prompts, len(too_long), records[0].file if records else "", kept_long)


def reward_meta(record: Record) -> dict[str, Any]:
    """What the reward worker gets with each sample of this prompt."""
    return {"data_source": record.data_source, "ground_truth": record.ground_truth, "extra_info": record.extra_info}


def load_prompt_set(spec: JobSpec, files_key: str = "train_files") -> PromptSet:
    """The prompts of ``files_key`` (``train_files`` or ``eval_files``); see the module docstring."""
    from rlctl.workload.reference import model_path_for

    model_dir = model_path_for(spec)
    if not (model_dir / "tokenizer.json").is_file():
        raise PreflightError([(f"{model_dir}: the job's model folder is missing (`rlctl launch` makes the reference "
                               "model; a job of your own names it in [model] path)")])
    prefix = "d" if files_key == "train_files" else "e"
    return tokenize_records(_records(spec, files_key), model_dir, int(spec.model["max_prompt_tokens"]), prefix,
                            bool(spec.data["filter_overlong_prompts"]), str(spec.data["truncation"]))


def load_prompts(spec: JobSpec) -> list[PromptRef]:
    """The training prompts (what the controller's scheduler owns)."""
    return load_prompt_set(spec).prompts


def load_held_out_prompts(spec: JobSpec) -> list[PromptRef]:
    """The held-out prompts (``[data] eval_files``, the first ``eval_max_prompts`` in file order);
    none when the job has no eval files or ``eval_every`` is 0."""
    data = spec.data
    if not data["eval_files"] or int(data["eval_every"]) <= 0:
        return []
    prompts = load_prompt_set(spec, "eval_files").prompts
    limit = int(data["eval_max_prompts"])
    return prompts[:limit] if limit > 0 else prompts


def preflight(spec: JobSpec) -> dict[str, Any]:
    """Check the model folder, the data, the reward function and the environment class; returns
    facts for the plan.

    Raises ``PreflightError`` listing every problem (each names the file, key or column).
    Blocking: reads every data row and imports the reward function.
    """
    problems: list[str] = []
    facts: dict[str, Any] = {}
    if spec.hf_model:
        try:
            model_dir = check_model_dir(spec.model["path"])
            facts["model"] = model_dir.summary()
            facts["sizing"] = plan_sizes(spec, ModelShape.from_hf_config(model_dir.config)).to_dict()
        except (ModelDirError, SizingError) as exc:
            problems.append(f"[model] path: {exc}")
    if spec.hf_model and not problems:
        for files_key in ("train_files", "eval_files"):
            if files_key == "eval_files" and not spec.data["eval_files"]:
                continue
            try:
                prompt_set = load_prompt_set(spec, files_key)
            except (DataError, ValueError) as exc:
                problems.append(f"[data] {files_key}: {exc}")
                continue
            facts[files_key] = {"prompts": len(prompt_set.prompts), "too_long": prompt_set.too_long,
                                "truncated": prompt_set.truncated}
            needed = max(spec.rollout.batch_prompts, spec.long_batch)
            if files_key == "train_files" and len(prompt_set.prompts) < needed:
                problems.append(f"[data] {files_key}: {len(prompt_set.prompts)} usable prompts "
                                f"({prompt_set.too_long} longer than model.max_prompt_tokens = "
                                f"{spec.model['max_prompt_tokens']}); expected at least one batch ({needed})")
    if spec.hf_model:
        reward = RewardSpec.from_table(spec.reward)
        try:
            load_function(reward)
            facts["reward"] = reward.label
        except RewardFunctionError as exc:
            problems.append(str(exc))
    if spec.multi_turn:
        from rlctl.workload.envs import EnvError, load_env_class

        try:
            load_env_class(spec.env)
            facts["env"] = f"{spec.env.class_ref}, {spec.env.max_turns} turns at most, {spec.roles['env'].nodes} env node(s)"
        except EnvError as exc:
            problems.append(str(exc))
    if problems:
        raise PreflightError(problems)
    return facts
