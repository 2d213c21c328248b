"""Entry point: ``python -m rlctl_agent --config PATH`` (and ``python3 agent.pyz --config PATH``).

The configuration file holds the job secret, so it is the only way to pass it: never argv, never
the environment, never the log.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from . import AGENT_VERSION
from .agent import Agent
from .config import ConfigError, load_config

EXIT_CONFIG_ERROR = 2
EXIT_OS_ERROR = 1


def main(argv: list[str] | None = None) -> int:
    """Run the agent until shutdown; return the process exit status."""
    parser = argparse.ArgumentParser(prog="rlctl-agent", description="rlctl node agent")
    parser.add_argument("--config", required=True, type=Path, help="agent config JSON (mode 0600)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"rlctl-agent {AGENT_VERSION}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"rlctl-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        return asyncio.run(Agent(config).run())
    except OSError as exc:  # e.g. the workdir or the worker socket cannot be created
        print(f"rlctl-agent: {exc}", file=sys.stderr)
        return EXIT_OS_ERROR


if __name__ == "__main__":
    sys.exit(main())
