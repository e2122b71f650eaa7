"""Relay: a self-hosted control plane for DBOS executors."""

__version__ = "0.2.0"
