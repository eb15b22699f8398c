"""Everything that runs on the GPU box, in wings by who runs the code (README: Module map).

- ``onbox.common``: the ground floor every wing uses (errors, durable writes, the run
  directory, the job environment's names, paths from outside, the redactor).
- ``onbox.train``: the training API, imported by the job's own Python (standard library and
  torch only; framework callbacks inside it). Imports nothing of the agent.
- ``onbox.sealing``: what a complete checkpoint is, sealing it to a store, the store's ledger,
  restore; ``onbox.sealing.stores`` the stores themselves.
- ``onbox.agent``: supervision (states, supervisor, runner, shim, lock, daemon, classify,
  journal) and the agent's use of sealing.
- ``onbox.cli``: ``rgt-agent``, the front door that wires the wings together.

Never imports ``controller``. Modules here keep to Python 3.9.
"""

import os


def import_root() -> str:
    """The directory this ``onbox`` package is imported from (a venv's site-packages, a
    checkout): what rgt's own processes put first on their ``PYTHONPATH``."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
