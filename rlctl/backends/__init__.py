"""rlctl.backends package."""
