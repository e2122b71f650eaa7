"""Relay's own durable DBOS workflows.

The grace period, recovery and failover sequences live here as DBOS
workflows (issue 3), so that a crash of Relay loses no timer and repeats no
action. Nothing is registered yet: up to DISCONNECTED, liveness needs no
durable state beyond the registry row.
"""
