"""rlctl.controller package."""
