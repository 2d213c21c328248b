"""Launch-time checks of ``[observability]``: each problem names its key, and nothing starts.

The endpoint's address must be bindable now (the controller binds it again before it allocates
a node), the TensorBoard directory writable, and each chosen sink's package installed; W&B online
needs a login. Nothing here reaches the network.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from rlctl.core.schema import Problem
from rlctl.core.spec import ObservabilitySpec

WANDB_DEFAULT_HOST = "api.wandb.ai"


def observability_problems(settings: ObservabilitySpec) -> list[Problem]:
    problems: list[Problem] = []
    if settings.prometheus_port:
        problem = _bind_problem(settings.prometheus_address, settings.prometheus_port)
        if problem:
            key = "observability.prometheus_address" if "address" in problem else "observability.prometheus_port"
            problems.append(Problem(key, problem))
    if settings.tensorboard_dir:
        if importlib.util.find_spec("tensorboard") is None:
            problems.append(Problem("observability.tensorboard_dir",
                                    "needs the tensorboard package: pip install 'rlctl[tensorboard]'"))
        problem = _writable_problem(Path(settings.tensorboard_dir))
        if problem:
            problems.append(Problem("observability.tensorboard_dir", problem))
    if settings.wandb_project:
        if importlib.util.find_spec("wandb") is None:
            problems.append(Problem("observability.wandb_project", "needs the wandb package: pip install 'rlctl[wandb]'"))
        elif settings.wandb_mode == "online" and not wandb_login_present():
            problems.append(Problem("observability.wandb_mode",
                                    "online needs a W&B login (set WANDB_API_KEY or run `wandb login`), "
                                    "or wandb_mode = \"offline\""))
    return problems


def _bind_problem(address: str, port: int) -> str:
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"expected an address of this machine, got {address!r} ({exc.strerror})"
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == 99:  # EADDRNOTAVAIL
                return f"expected an address of this machine, got {address!r}"
            return f"cannot listen on {address}:{port}: {exc.strerror} (another process has the port?)"
    return ""


def _writable_problem(directory: Path) -> str:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".rlctl-write-check-"):
            pass
    except OSError as exc:
        return f"expected a writable directory, got {str(directory)!r}: {exc.strerror or exc}"
    return ""


def wandb_login_present() -> bool:
    """An API key in the environment, or in ~/.netrc for the W&B host (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", f"https://{WANDB_DEFAULT_HOST}")).hostname or WANDB_DEFAULT_HOST
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
