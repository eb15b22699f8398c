"""The job's ``sitecustomize``: rgt copies this file to the root of the job's lib
(onbox/agent/runner.py ``ensure_job_lib``), first on the job's PYTHONPATH, so every Python
process of the attempt runs it at start.

It owns one thing: a ``faulthandler`` handler for ``STACKS_SIGNAL`` that writes every thread's
Python stack to ``$RGT_STACKS_FILE``, the stall probe's fallback where py-spy cannot attach
(onbox/health/stacks.py). faulthandler dumps from inside the signal handler, without the GIL, so
a process stuck in a C call (a blocked read, a sleep, a collective) still answers. Then it runs
the next ``sitecustomize`` on ``sys.path`` (Debian's, a user's), as if this one were not there.

It must never keep the job's Python from starting: each part is guarded, and a failure only
means no hook. Standard library only; runs on the box's Python (3.9+).
"""

import os
import sys


def _install() -> None:
    from onbox.common import jobenv  # rgt's job lib, the directory this file sits in

    path = os.environ.get(jobenv.STACKS_FILE)
    if not path:
        return
    import faulthandler

    # faulthandler keeps a reference to the file (and writes to its fd) for the process's life.
    f = open(path, "a")  # noqa: SIM115 (kept open on purpose)
    faulthandler.register(jobenv.STACKS_SIGNAL, file=f, all_threads=True, chain=False)


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, under the same name."""
    import importlib.machinery
    import importlib.util

    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = mod
    # Its own errors reach site.py as they would without rgt (a message, and Python goes on).
    spec.loader.exec_module(mod)


try:
    _install()
except Exception:  # no hook (an unwritable run dir, an odd Python): py-spy may still attach
    pass
_chain()
