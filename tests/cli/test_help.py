"""`rlctl --help` and every group's help: one line of summary per command, cut at a sentence."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import typer

from rlctl.cli.app import app, command_summary


def _commands(typer_app: typer.Typer) -> list[typer.models.CommandInfo]:
    found = list(typer_app.registered_commands)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            found += _commands(group.typer_instance)
    return found


def test_every_command_has_a_one_sentence_summary() -> None:
    commands = _commands(app)
    assert len(commands) >= 15
    for info in commands:
        assert info.short_help and "\n" not in info.short_help, info.name
        assert not re.search(r"\.\s+[A-Z]", info.short_help), info.short_help  # one sentence


def test_the_summary_is_the_docstrings_first_sentence_on_one_line() -> None:
    doc = """Stop a job: the trainer checkpoints, then workers are
    stopped. Nothing is deleted.

    More detail."""
    assert command_summary(doc) == "Stop a job: the trainer checkpoints, then workers are stopped."
    assert command_summary("Print rlctl's version.") == "Print rlctl's version."
    assert command_summary("Measure the curve (e.g. seconds)\n    by degree") == "Measure the curve (e.g. seconds) by degree"
    assert command_summary(None) is None


def test_the_top_level_help_lists_each_summary_whole() -> None:
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb"}
    shown = subprocess.run([sys.executable, "-m", "rlctl.cli", "--help"], capture_output=True, text=True, env=env,
                           timeout=60, check=True).stdout
    for info in app.registered_commands:
        assert info.short_help is not None and info.short_help in shown, info.name
