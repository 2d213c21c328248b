"""Role programs of the reference GRPO job: `python -m rlctl.roles.{trainer,rollout,reward}`.

Each is a plain synchronous program that talks to the controller through the worker SDK
(rlctl.worker) and reports its phase and progress so role-aware detection can judge it.
"""
