"""The `rlctl` command line: a thin typer app; each command group lives in its own module.

Nothing heavy is imported here (no torch, vllm or ucxx): `rlctl --help` must stay fast.
"""

from __future__ import annotations

import re

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
        ("rlctl.cli.convert", "convert_app", "convert", True),
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


_SENTENCE_END = re.compile(r"\.\s+(?=[A-Z`])")  # not "e.g. seconds"


def command_summary(doc: str | None) -> str | None:
    """A command's line in a ``--help`` list: the first sentence of its docstring on one line (rich
    help keeps a docstring's line breaks, which cut the list's lines mid-sentence)."""
    if not doc:
        return None
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    end = _SENTENCE_END.search(paragraph)
    return paragraph if end is None else paragraph[:end.start() + 1]


def _summarize(typer_app: typer.Typer) -> None:
    """Give every command of ``typer_app`` and of its groups its one-line summary, unless it has one."""
    for info in typer_app.registered_commands:
        if info.short_help is None and info.callback is not None:
            info.short_help = command_summary(info.help or info.callback.__doc__)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _summarize(group.typer_instance)


_register_optional()
_summarize(app)


def main() -> None:
    app()
