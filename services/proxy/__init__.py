"""The request distributor (``conveyor serve proxy``): one OpenAI endpoint in front of several
api_servers, with LMDeploy's node routes and dispatch strategies (app.py, nodes.py,
strategies.py, health.py, relay.py) and who may change its nodes (admin.py). The api_server's
side of joining it is the ingress's (``ingress/proxy_registration.py``)."""

from .app import build_proxy_app
from .nodes import Node, NodeTable
from .process import run_proxy
from .strategies import Candidate, Strategy, pick

__all__ = ["Candidate", "Node", "NodeTable", "Strategy", "build_proxy_app", "pick", "run_proxy"]
