"""Relay's own durable DBOS workflows: the grace period and the recovery.

A crash of Relay loses no timer (DBOS keeps ``recv`` and ``sleep`` deadlines)
and repeats no action that matters (each step is safe to run again).
"""
