"""Names of 2,000 characters for harness/workflow_app.py's long-named workflow and step, in a module
of their own so that a test can name them without importing the app (which registers its workflows
with DBOS)."""

from __future__ import annotations

import random
import string


def long_name(prefix: str, seed: int) -> str:
    """A name of 2,000 characters, random so that PostgreSQL's indexes hold it uncompressed."""
    chosen = random.Random(seed).choices(string.ascii_letters + string.digits, k=2000 - len(prefix))
    return prefix + "".join(chosen)


# A custom name, as ``@DBOS.workflow(name=...)`` gives one: class-qualified names are long in real apps.
LONG_WORKFLOW_NAME = long_name("long-workflow-", 1)
LONG_STEP_NAME = long_name("long-step-", 2)
