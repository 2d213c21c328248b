"""rlctl.weights package."""
