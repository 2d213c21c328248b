"""Where a job's figures go besides `rlctl status`: the controller's Prometheus endpoint
(``prometheus``), the training-curve sinks, TensorBoard and Weights & Biases (``curves``), and the
launch-time checks of ``[observability]`` (``checks``). The values themselves are decided in
``rlctl.core.telemetry``; this package only carries them out. Torch-free: the controller runs it.
"""
