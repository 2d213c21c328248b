"""rlctl node agent: stdlib-only program that runs on every node of a job.

It registers the node with the job's controller, heartbeats, samples the GPU provider,
supervises role workers, relays the worker SDK and carries out injected faults.
"""

AGENT_VERSION = "0.1.0"
