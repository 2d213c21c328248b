"""rlctl.core package."""
