"""`rlctl model init|check`, `rlctl data gsm8k` and `rlctl export`: Hugging Face folders in and out.

`model init` and `data gsm8k` make a tiny checkpoint and a verl-layout data set here (nothing is
downloaded); `model check` runs the launch's model-folder check alone; `export` copies a job's
checkpoint out as a folder transformers and vLLM load directly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from rlctl.cli.common import console, fail, print_json, resolve_job
from rlctl.core.checkpoint_names import STEP_FOLDER_PREFIX

model_app = typer.Typer(help="Make or check a Hugging Face model folder.", no_args_is_help=True)
data_app = typer.Typer(help="Make prompt data in verl's layout.", no_args_is_help=True)

STEP_PREFIX = STEP_FOLDER_PREFIX
TRAINER_ONLY_FILES = ("trainer_state.pt",)


@model_app.command("init")
def model_init(
    target: Path = typer.Argument(..., help="Folder to write (created; model files in it are overwritten)."),
    arch: str = typer.Option("qwen3", "--arch", help="qwen3 or llama."),
    size: str = typer.Option("tiny", "--size", help="tiny (~0.9 M parameters), small (~14 M) or 0.5b."),
    seed: int = typer.Option(0, "--seed", help="Seed of the tokenizer corpus and the random init."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
) -> None:
    """Make a random-init HF checkpoint with a tokenizer trained here and a chat template."""
    from rlctl.workload.hf_init import ARCHITECTURES, SIZES

    if arch not in ARCHITECTURES:
        fail(f"--arch: expected one of {', '.join(ARCHITECTURES)}, got {arch!r}", 2)
    if size not in SIZES:
        fail(f"--size: expected one of {', '.join(SIZES)}, got {size!r}", 2)
    from rlctl.workload.hf_init import init_checkpoint
    from rlctl.workload.modeldir import check_model_dir

    with console.status(f"making a {size} {arch} checkpoint in {target}"):
        init_checkpoint(target, arch, size, seed)
        summary = check_model_dir(target, load_config=False).summary()
    if json_out:
        print_json(summary)
    else:
        console.print(f"wrote {target}: {arch} {size}, vocab {summary['vocab_size']}, {', '.join(summary['weights'])}")


@model_app.command("warmstart")
def model_warmstart(
    source: Path = typer.Argument(..., help="The HF model folder to start from."),
    target: Path = typer.Argument(..., help="Folder for the warm-started model (reused when up to date)."),
    data: Path = typer.Option(None, "--data", help="A verl-layout file whose extra_info.answer holds reference "
                              "solutions (default: the reference task's answers)."),
    steps: int = typer.Option(600, "--steps", min=1, help="Optimizer steps of 32 examples."),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
) -> None:
    """Supervised warm-start on reference answers, so a short RL run has a signal to work with."""
    import json

    from rlctl.workload.hf_warmstart import SIDECAR, HFWarmStartConfig, prepare_warmstart
    from rlctl.workload.modeldir import ModelDirError, check_model_dir

    try:
        check_model_dir(source, load_config=False)
    except ModelDirError as exc:
        fail(str(exc), 2)
    with console.status(f"warm-starting {source} for {steps} steps into {target}"):
        try:
            prepare_warmstart(source, target, data, seed, HFWarmStartConfig(steps=steps))
        except ValueError as exc:
            fail(str(exc), 2)
    figures = json.loads((target / SIDECAR).read_text())
    if json_out:
        print_json(figures)
    else:
        console.print(f"{target}: loss {figures['first_loss']:.3f} -> {figures['final_loss']:.3f} "
                      f"({figures['seconds']:.0f} s when trained)")


@model_app.command("check")
def model_check(
    path: Path = typer.Argument(..., help="The model folder."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Let transformers run the folder's code."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
) -> None:
    """Check a model folder the way `rlctl launch` does (files, weight headers against the config, tokenizer)."""
    from rlctl.workload.modeldir import ModelDirError, check_model_dir

    try:
        summary = check_model_dir(path, trust_remote_code=trust_remote_code).summary()
    except ModelDirError as exc:
        fail(str(exc), 2)
    if json_out:
        print_json(summary)
    else:
        console.print(f"{path}: {summary['model_type']}, vocab {summary['vocab_size']}, "
                      f"chat template {'yes' if summary['chat_template'] else 'no'}")
        console.print(f"weights: {summary['weights_check']}", highlight=False)


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        fail(f"{option}: expected positive integers separated by commas, got {text!r}", 2)
    return values


@model_app.command("curve")
def model_curve(
    path: Path = typer.Argument(..., help="The model folder."),
    out: Path = typer.Option(..., "--out", help="JSON file to write: `[rollout.elastic] curve` names it."),
    degrees: str = typer.Option("1,2", "--degrees", help="Tensor-parallel degrees to measure (the base and the wide)."),
    batches: str = typer.Option("1,4,16", "--batches", help="Sequences per engine to measure at."),
    tokens: int = typer.Option(32, "--tokens", min=4, help="New tokens per measured decode run."),
    engine_name: str = typer.Option("torch", "--engine", help="torch (CPU: a degree is an intra-op thread) or vllm."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
) -> None:
    """Measure the engine curve elastic rollout parallelism decides with: decode-step seconds per
    degree and batch, and the time to rebuild an engine at another degree from held weights."""
    import json

    from rlctl.core.elastic import curve_from_json
    from rlctl.workload.modeldir import ModelDirError, check_model_dir

    degree_list, batch_list = _int_list(degrees, "--degrees"), _int_list(batches, "--batches")
    if engine_name not in ("torch", "vllm"):
        fail(f"--engine: expected torch or vllm, got {engine_name!r}", 2)
    try:
        summary = check_model_dir(path).summary()
    except ModelDirError as exc:
        fail(str(exc), 2)
    from rlctl.workload.engine_curve import measure_curve

    with console.status(f"measuring {engine_name} at degrees {degree_list}, batches {batch_list}") as shown:
        engine, state = _curve_engine(path, engine_name, degree_list[0])
        result = measure_curve(engine, state, degree_list, batch_list, tokens, int(summary["vocab_size"]),
                               devices=lambda degree: ",".join(str(i) for i in range(degree)) if engine_name == "vllm" else "",
                               on_point=lambda p: shown.update(f"degree {p['tensor_parallel']}, batch {p['batch']}: "
                                                              f"{p['step_s'] * 1e3:.2f} ms a step"))
    fitted = curve_from_json(result)
    document = {**result, "engine": engine_name, "model": str(path), "fitted": fitted.to_json()}
    out.write_text(json.dumps(document, indent=1) + "\n")
    if json_out:
        print_json(document)
        return
    for degree, (base_s, per_seq_s) in sorted(fitted.lines.items()):
        console.print(f"degree {degree}: {base_s * 1e3:.3f} ms + {per_seq_s * 1e3:.4f} ms per sequence a step")
    console.print(f"regroup: {fitted.regroup_s:.3f} s; wrote {out}")


def _curve_engine(path: Path, engine_name: str, degree: int) -> tuple[object, dict]:
    """The engine to measure and the weights it reloads after each rebuild (its own)."""
    from rlctl.workload.engine import SamplingConfig, TorchEngine
    from rlctl.workload.hf_model import load_hf_policy

    policy = load_hf_policy(path, "cpu")
    state = {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}
    sampling = SamplingConfig(eos_id=-1, pad_id=0)  # no stop: every sequence decodes the full count
    if engine_name == "torch":
        return TorchEngine(policy, sampling, device="cpu"), state
    from rlctl.workload.engine_vllm import VllmEngine, VllmOptions

    return VllmEngine(path, sampling, options=VllmOptions(tensor_parallel_size=degree)), state


@data_app.command("gsm8k")
def data_gsm8k(
    target: Path = typer.Argument(..., help="Folder for train.parquet and test.parquet."),
    train_rows: int = typer.Option(2000, "--train", min=1, help="Training rows."),
    test_rows: int = typer.Option(200, "--test", min=1, help="Held-out rows."),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
) -> None:
    """Write a GSM8K-layout data set (verl's columns) generated from arithmetic problems."""
    from rlctl.workload.gsm8k_layout import write_dataset

    written = write_dataset(target, train_rows, test_rows, seed)
    if json_out:
        print_json({split: str(path) for split, path in written.items()})
    else:
        for split, path in written.items():
            console.print(f"{split}: {path}")


def checkpoint_folders(checkpoints: Path) -> dict[int, Path]:
    """The job's HF-format checkpoints by step (folders ``step-NNNNNN`` holding a config.json)."""
    found: dict[int, Path] = {}
    if not checkpoints.is_dir():
        return found
    for entry in checkpoints.iterdir():
        if entry.is_dir() and entry.name.startswith(STEP_PREFIX) and (entry / "config.json").is_file():
            try:
                found[int(entry.name[len(STEP_PREFIX):])] = entry
            except ValueError:
                continue
    return found


def refuse_corrupt(job_id: str, step: int, folders: dict[int, Path], instead: str) -> None:
    """Fail, naming the file, when the checkpoint of ``step`` does not match its checksums; the
    message names the newest valid checkpoint before it and the command (``instead``, with
    ``{step}``) that would use it."""
    from rlctl.workload.checkpoint_manifest import CheckpointCorruptError, newest_valid, verify_checkpoint

    try:
        verify_checkpoint(folders[step])
    except CheckpointCorruptError as corrupt:
        fallback = newest_valid(folders, below=step).step
        use = (f"; the newest valid checkpoint is step {fallback}: {instead.format(step=fallback)}"
               if fallback is not None else "; no checkpoint before it is valid either")
        fail(f"{job_id}: the checkpoint of step {step} is corrupt: {corrupt}{use}")


def export(
    job: str = typer.Argument(..., help="Job id (or a unique prefix)."),
    target: Path = typer.Argument(..., help="Folder to write; must not exist or be empty."),
    step: int = typer.Option(None, "--step", help="Checkpoint step (default: the newest)."),
    state_dir: str = typer.Option(None, "--state-dir", help="Where job directories live."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
) -> None:
    """Write a job's checkpoint as a Hugging Face folder (model, config, tokenizer; no optimizer)."""
    jobdir = resolve_job(job, state_dir)
    folders = checkpoint_folders(jobdir.checkpoints)
    if not folders:
        single_files = sorted(p.name for p in jobdir.checkpoints.glob("step-*.pt")) if jobdir.checkpoints.is_dir() else []
        why = (f"its checkpoints ({', '.join(single_files[-3:])}) are the built-in model's; export needs a job with "
               "[model] path" if single_files else "it has no checkpoint yet")
        fail(f"{jobdir.job_id}: nothing to export: {why}")
    chosen = max(folders) if step is None else step
    if chosen not in folders:
        fail(f"--step: {jobdir.job_id} has no checkpoint of step {chosen} (steps: {', '.join(map(str, sorted(folders)))})", 2)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        fail(f"{target}: expected a new or empty folder", 2)
    source = folders[chosen]
    refuse_corrupt(jobdir.job_id, chosen, folders, f"rlctl export {job} --step {{step}} {target}")
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(*TRAINER_ONLY_FILES))
    if target.exists():
        target.rmdir()
    staging.rename(target)
    files = sorted(p.name for p in target.iterdir())
    if json_out:
        print_json({"job_id": jobdir.job_id, "step": chosen, "path": str(target), "files": files})
    else:
        console.print(f"exported {jobdir.job_id} step {chosen} to {target} ({', '.join(files)})")
