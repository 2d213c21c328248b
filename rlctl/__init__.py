"""rlctl: an orchestrator for LLM RL post-training that recovers only the role that failed."""

__version__ = "0.1.0"
