"""rlctl.cli package."""
