"""rlctl.workload package."""
