"""The ingress's routes, one module per group; ``build_app`` (``../app.py``) installs them."""

from .adapters import install_adapters
from .completions import install_completions
from .interactive import install_interactive
from .status import install_status

__all__ = ["install_adapters", "install_completions", "install_interactive", "install_status"]
