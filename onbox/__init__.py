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


DIST_NAME = "remote-gpu-trainer"  # rgt's distribution (controller/deploy/wheel.py builds it)


def version() -> str:
    """The version of the rgt that runs, as ``rgt-agent --version`` says it (click asks
    importlib.metadata): read from the METADATA of the one dist-info beside this ``onbox``, as pip
    installs rgt's wheel; else (a checkout, more than one) from importlib.metadata, whose import
    alone (the email package, zipfile) made `rgt deploy`'s look at a run half as long again."""
    root = import_root()
    prefix = DIST_NAME.replace("-", "_") + "-"
    try:
        infos = [n for n in os.listdir(root) if n.startswith(prefix) and n.endswith(".dist-info")]
    except OSError:
        infos = []
    if len(infos) == 1:
        try:
            with open(os.path.join(root, infos[0], "METADATA"), encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        break  # the headers end here
                    if line.startswith("Version:"):
                        return line[len("Version:") :].strip()
        except (OSError, ValueError):
            pass
    import importlib.metadata  # (only here: every other start goes without it)

    return importlib.metadata.version(DIST_NAME)
