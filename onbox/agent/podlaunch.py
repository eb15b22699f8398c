"""The job container's first process in a Kubernetes pod: ``python3 -m onbox.agent.podlaunch
RUN_DIR [RUN_DIR ...]`` (with several, an Indexed Job's: the one at $JOB_COMPLETION_INDEX).

Why a launcher: on cgroup v2 one OOM kill takes every process of a container, so the agent lives
in a container of its own (a native sidecar; onbox/agent/podrunner.py) and the job in this one,
in the job's image. The agent cannot fork into another container, so this launcher does it for
the agent: for each spawn request the agent writes into the shared run directory
(``pod/spawn-N.json``) it starts ``onbox.agent.shim`` as its child, exactly as the agent would
on a box; the shim starts the job and writes job.json and exit.json there, and the agent, in the
same PID namespace (``shareProcessNamespace``), watches and signals them by pid as it does an
attempt it adopted.

Stopping: the kubelet sends SIGTERM to this container first (a native sidecar is stopped after
the main containers). The launcher ignores it for itself and passes it to the agent (its pid and
start time in ``pod/agent.json``, again to each new agent that appears while the stop is on), so
the agent runs its preemption path: asks the job for a checkpoint, stops it within the grace,
seals. When the agent reaches a terminal state it writes ``pod/final.json`` with its exit code
(onbox/common/errors.py FINAL_EXIT_CODES); the launcher exits with that code, which is what
``podFailurePolicy``'s ``onExitCodes`` reads on this (the main) container.

Imports only the standard library and onbox's ground floor (it runs in the job's image, from the
job lib the agent publishes at ``$RGT_HOME/lib/pod``). Python 3.9.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from onbox.agent import procfs
from onbox.common.durable import read_json, write_json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Set

POD = "pod"  # under the run dir: what the agent and the launcher tell each other
AGENT = "agent.json"  # the agent's pid and start time (the agent writes it)
LAUNCHER = "launcher.json"  # the launcher's (the launcher writes it)
FINAL = "final.json"  # the run's final state and exit code (the agent writes it)
SPAWN = re.compile(r"^spawn-(\d+)\.json$")  # a request to start attempt N (the agent)
POD_LIB = os.path.join("lib", "pod")  # under RGT_HOME: the job lib, a stable name
POLL = 0.1  # how often the launcher looks at the shared directory
SAY_EVERY = 30.0  # how often a launcher still waiting for the agent says so


def pod_file(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, POD, name)


def spawn_file(run_dir: str, attempt: int) -> str:
    return pod_file(run_dir, f"spawn-{attempt}.json")


def identity_doc() -> Dict[str, Any]:
    """This process as the other side finds it again (pid reuse is told apart by start time)."""
    me = procfs.identity(os.getpid())
    return {
        "pid": os.getpid(),
        "start_ticks": me.start_ticks if me else -1,
        "boot_id": procfs.boot_id(),
        "at": time.time(),
    }


def recorded(path: str) -> Optional[procfs.Identity]:
    """The live process a pod file names, else None (gone, or its pid reused)."""
    try:
        doc = read_json(path)
    except ValueError:
        return None
    if not doc or doc.get("boot_id") not in (None, procfs.boot_id()):
        return None
    ident = procfs.Identity(int(doc["pid"]), int(doc["start_ticks"]))
    return ident if procfs.is_alive(ident) else None


class Launcher:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.started: Set[int] = set()
        self.children: List[subprocess.Popen[bytes]] = []
        self.stop_asked = False
        self.told: Optional[procfs.Identity] = None  # the agent the stop went to

    def _on_term(self, signum: int, frame: object) -> None:
        self.stop_asked = True  # acted on in the loop, never inside the handler

    def say(self, text: str) -> None:
        print(f"rgt podlaunch: {text}", file=sys.stderr, flush=True)

    def start_shim(self, attempt: int) -> None:
        # The shim's report on its fd is for an agent that started it; the agent here reads
        # job.json and exit.json instead.
        ready = os.open(os.devnull, os.O_WRONLY)
        log = os.open(
            os.path.join(self.run_dir, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
        try:
            self.children.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-m", "onbox.agent.shim"]
                    + [self.run_dir, str(attempt), str(ready)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(ready,),
                    start_new_session=True,
                    cwd="/",
                )
            )
        finally:
            os.close(ready)
            os.close(log)
        self.say(f"started the shim of attempt {attempt}")

    def requests(self) -> List[int]:
        try:
            names = os.listdir(os.path.join(self.run_dir, POD))
        except FileNotFoundError:
            return []
        found = (SPAWN.match(n) for n in names)
        return sorted(int(m.group(1)) for m in found if m and int(m.group(1)) not in self.started)

    def pass_stop(self) -> None:
        """SIGTERM to the agent (each new one once: a restarted sidecar must hear it too)."""
        agent = recorded(pod_file(self.run_dir, AGENT))
        if agent is None or agent == self.told:
            return
        try:
            os.kill(agent.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        self.told = agent
        self.say(f"SIGTERM passed to the agent (pid {agent.pid}): it seals, then stops the job")

    def final_code(self) -> Optional[int]:
        try:
            doc = read_json(pod_file(self.run_dir, FINAL))
        except ValueError:
            return None
        return None if doc is None else int(doc["code"])

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        waited_since = time.monotonic()
        while not os.path.isdir(os.path.join(self.run_dir, POD)):
            # The agent makes the run dir; the kubelet starts us only after its startup probe,
            # so this is short. Unbounded: the pod's own deadline bounds it.
            if time.monotonic() - waited_since > SAY_EVERY:
                self.say(f"still waiting for the agent to make {self.run_dir}")
                waited_since = time.monotonic()
            time.sleep(POLL)
        write_json(pod_file(self.run_dir, LAUNCHER), identity_doc())
        while True:
            for child in self.children:
                child.poll()  # reap an ended shim; its exit.json tells the agent
            for attempt in self.requests():
                self.started.add(attempt)
                self.start_shim(attempt)
            if self.stop_asked:
                self.pass_stop()
            code = self.final_code()
            if code is not None:
                self.say(f"the run ended; exiting {code}")
                return code
            time.sleep(POLL)


def pick(run_dirs: List[str], environ: Dict[str, str]) -> str:
    if len(run_dirs) == 1:
        return run_dirs[0]
    return run_dirs[int(environ["JOB_COMPLETION_INDEX"])]


def main(argv: List[str]) -> int:
    if not argv:
        raise SystemExit("usage: python3 -m onbox.agent.podlaunch RUN_DIR [RUN_DIR ...]")
    os.umask(0o077)
    return Launcher(os.path.abspath(pick(argv, dict(os.environ)))).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
