"""``python -m rlctl.cli`` is the same as the ``rlctl`` command."""

from rlctl.cli.app import main

main()
