"""The engine stage: the service loop around an Engine (service.py) and the process entry point (process.py)."""
