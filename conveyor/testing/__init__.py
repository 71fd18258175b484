"""Test support that tests and benchmarks share (installed with the package, never imported by it).

- ``fake_engine``: an engine without a model (``FakeEngine``; ``build`` is its engine factory).
- ``serve``: ``python -m conveyor.testing.serve api_server MODEL``, the real stages around an
  engine factory's engine (the fake one by default).
- ``server_process``: ``ServerProcess``, such a server (or a real one) in a subprocess, and the
  ports and health checks of a deployment started stage by stage; ``free_port``.
- ``waiting``: ``wait_until``, polling a condition with a deadline.

Import the modules by path (``from conveyor.testing.fake_engine import FakeEngine``): this file
imports nothing, so that reaching one of them does not pay for the others (the fake engine
pulls in torch; the server helpers do not need it).
"""
