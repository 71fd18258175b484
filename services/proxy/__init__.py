"""The request distributor (``conveyor serve proxy``): one OpenAI endpoint in front of several
api_servers, with LMDeploy's node routes and dispatch strategies (app.py, nodes.py,
strategies.py, health.py, relay.py), who may change its nodes (admin.py), and the api_server's
side of joining it (registration.py)."""

from .app import build_proxy_app
from .nodes import Node, NodeTable
from .process import run_proxy
from .registration import ProxyRegistration
from .strategies import Candidate, Strategy, pick

__all__ = ["Candidate", "Node", "NodeTable", "ProxyRegistration", "Strategy", "build_proxy_app", "pick", "run_proxy"]
