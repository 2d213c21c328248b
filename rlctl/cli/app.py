"""The `rlctl` command line: a thin typer app; each command group lives in its own module.

Nothing heavy is imported here (no torch, vllm or ucxx): `rlctl --help` must stay fast.
"""

from __future__ import annotations

import typer

from rlctl import __version__
from rlctl.cli import launch as launch_cmd
from rlctl.cli import status as status_cmd
from rlctl.cli import stop as stop_cmd

app = typer.Typer(
    name="rlctl",
    help="Run LLM RL post-training on bare-metal clusters (local, SSH, Slurm) and recover only the role that failed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("launch")(launch_cmd.launch)
app.command("status")(status_cmd.status)
app.command("jobs")(status_cmd.jobs)
app.command("nodes")(status_cmd.nodes)
app.command("events")(status_cmd.events)
app.command("stop")(stop_cmd.stop)
app.command("resume")(launch_cmd.resume)


def _register_optional() -> None:
    """Command groups whose modules may be absent in a partial checkout are added when present."""
    import importlib

    for module_name, attr, name, is_group in (
        ("rlctl.cli.faults", "inject_fault", "inject-fault", False),
        ("rlctl.cli.faults", "chaos", "chaos", False),
        ("rlctl.cli.report", "report", "report", False),
        ("rlctl.cli.lab", "lab_app", "lab", True),
        ("rlctl.cli.sim", "sim", "sim", False),
        ("rlctl.cli.model", "model_app", "model", True),
        ("rlctl.cli.model", "data_app", "data", True),
        ("rlctl.cli.model", "export", "export", False),
    ):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        target = getattr(module, attr)
        if is_group:
            app.add_typer(target, name=name)
        else:
            app.command(name)(target)


@app.command("spec-doc")
def spec_doc() -> None:
    """Print the job.toml reference (docs/job-spec.md is generated from this)."""
    from rlctl.core.spec import spec_reference_markdown

    typer.echo(spec_reference_markdown(), nl=False)


@app.command("version")
def version() -> None:
    """Print rlctl's version."""
    typer.echo(__version__)


_register_optional()


def main() -> None:
    app()
