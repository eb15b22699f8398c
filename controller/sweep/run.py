"""``rgt sweep PLAN.toml``: fan the cells out over the plan's boxes, one sequential queue per box,
and track them until every queue is done (or, ``--no-wait``, deploy each idle box's next cell
and return). The queues run side by side, each in its own thread (``Driver.drive``): a box's
deploy never waits for another box's, up to MAX_AT_ONCE boxes at a time. Each change of the
record is its own read-modify-write under the record's lock (record.py ``update``), each line
said is written whole, and a deploy's lines (the box's relayed stderr too) name their box.

Each cell is deployed with rgt's own deploy (controller/deploy/flow.py), as its own run: run
name = the cell's (``NAME-rK`` for a fresh re-run), store = the plan's store (the run's prefix
under it), outputs = the cell's own paths, ``RGT_CELL``/``RGT_SWEEP`` in its environment (the
command is run through ``env``). A box's next cell is deployed when its current one ends:
succeeded once the store holds its DONE.json, failed when its run FAILED (or was STOPPED). A
current cell whose agent is gone while the run is not done (the box died, rebooted, was
preempted) is deployed again under the same name: its agent restores the newest verified
checkpoint from the store and the cell resumes mid-way. A box that does not answer for
``MAX_MISSES`` polls in a row, or whose deploy fails, is left with its cells pending.

Progress is kept in the sweep record (controller/sweep/record.py), so running ``rgt sweep``
again resumes: a cell whose store has DONE.json is skipped, a live one is followed, a dead one
deployed again, and each cell the last ``rgt reconcile`` found failed or unverified gets a fresh
run of the identical config (a run whose store holds DONE.json never trains again).

Whether a cell is sealed is read from the store as every store read is (retried past a blip);
a store that cannot say (after those retries, or past its ``[store] stall``) is no box's doing:
no queue is left for it, the sweep ends with the store's error (SweepStoreUnread, exit 14).

A cell the sweep saw succeed (it read its DONE.json in the store) that the last reconcile found
missing is continued under its own name when the store still holds its run's epoch (its result
was lost there); when the store holds no trace of it at all, the laptop is most likely reading
another store than the one its box writes to, and the sweep ends before deploying anything
(WrongStore, exit 21): deployed again, every such cell's agent would refuse a run it finished.

Exit: 0 when every cell succeeded; 11 when some failed (FINAL_EXIT_CODES' FAILED); 3 when a box
was left with cells to do (RemoteUnreachable's code); 14 when the store could not be read; 21
when the store holds nothing of cells the sweep saw succeed; 0 with ``--no-wait`` once
deployed.
"""

from __future__ import annotations

import dataclasses
import importlib
import shlex
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from controller import boxrun, children
from controller.registry import Registry
from controller.remote import Remote, open_remote
from controller.results.sealed import has_trace, wrong_store
from controller.runstore import open_sweep_store
from controller.sweep import record
from controller.sweep.plan import Cell, Plan, check_store_here
from controller.target import parse_target
from onbox.agent.states import LIVE_NAMES
from onbox.common import terminal
from onbox.common.errors import (
    FINAL_EXIT_CODES,
    LockedError,
    NotFound,
    RemoteUnreachable,
    RgtError,
    StoreError,
    UsageError,
    WrongStore,
)
from onbox.common.terminal import labelled_say, say
from onbox.sealing import manifest as mf
from onbox.sealing.stores.base import with_retries
from onbox.sealing.stores.hangbound import StoreHung
from onbox.sealing.stores.local import LocalStore

MAX_MISSES = 10  # polls in a row a box may not answer before its queue is left
MAX_REDEPLOYS = 3  # deploys of one dead cell per invocation, before its box is left
# Boxes polled or deployed to at once (each box has at most one deploy in flight: its queue is
# one thread): a sweep over more boxes goes through them as slots free, so that this laptop
# never runs more than this many deploys' ssh sessions and uploads at a time.
MAX_AT_ONCE = 8
# The sweep's store is read by one box's queue at a time: a store's bound on its calls keeps
# one hung call's state (hangbound.py), made for calls one at a time.
_STORE_READS = threading.Lock()
Say = Callable[[str], None]


_say = say  # progress lines; one stderr will not take is dropped (terminal.say)


def _until_all(done: List[Box], n: int) -> None:
    """Wait until ``n`` queues are ``done``, in short sleeps that a Ctrl-C interrupts cleanly
    (not Thread.join: one interrupted marks the thread it waited for as ended, Python 3.11,
    while it runs on)."""
    while len(done) < n:
        time.sleep(0.1)


class SweepStoreUnread(StoreError):
    """The sweep's own store could not say whether a cell is sealed (after the store layer's
    retries): no box's doing, so no queue is left for it; every queue waits on the store, and
    the sweep ends (exit 14) naming the cell and the read."""


@dataclasses.dataclass
class Box:
    """One target's queue, as this invocation drives it."""

    target: str
    remote: Optional[Remote] = None
    misses: int = 0
    redeploys: int = 0
    left: Optional[str] = None  # why this box's queue was left, when it was


def deploy_command(cell: Cell) -> List[str]:
    """The cell's command, its environment passed through ``env`` (the deploy has no per-run
    environment of its own)."""
    return ["env", *[f"{k}={v}" for k, v in sorted(cell.env.items())], *cell.command]


def show_plan(plan: Plan, say: Say) -> None:
    """What the sweep would do (``--dry-run``)."""
    from controller.sweep.plan import assign

    if plan.slurm:
        say(f"sweep {plan.name}: {len(plan.cells)} cells as one Slurm job array on {plan.slurm}")
        queues = {plan.slurm: plan.cells}
    else:
        say(f"sweep {plan.name}: {len(plan.cells)} cells over {len(plan.targets)} box(es)")
        queues = assign(plan.cells, plan.targets)
    for box, cells in queues.items():
        say(f"{box}: {len(cells)} cells, cost {sum(c.cost for c in cells):g}")
        for c in cells:
            outs = f"; outputs {', '.join(c.outputs)}" if c.outputs else ""
            say(f"  {c.index:>4} {c.name} (cost {c.cost:g}): {shlex.join(c.command)}{outs}")
    say(f"store: {plan.store} (each cell under its run name)")


def _redeploys_left(name: str, times: int, cell: Dict[str, Any]) -> str:
    """Why a box is left whose current cell ``name`` was taken as gone ``times`` times: the
    error its last deploy again failed with, which the cell keeps (``_deploy_recorded``; a
    deploy that went through clears it), else its agent dying each time."""
    error = cell.get("error")
    if isinstance(error, str) and error:
        return f"{name} could not be deployed again: {error.removeprefix('rgt: ')}"
    return f"{name}'s agent died {times} times"


class Driver:
    """One invocation of ``rgt sweep`` over the boxes of a plan."""

    def __init__(self, plan: Plan, say: Say, interval: float, home: Optional[str]) -> None:
        self.plan = plan
        self.say = say
        self.interval = interval
        self.home = home
        self.registry = Registry(home)
        self.store = open_sweep_store(plan.store or "", plan.store_endpoint, plan.store_stall)
        self.cells = {c.name: c for c in plan.cells}
        self.boxes = [Box(t) for t in plan.targets]

    def _set(self, name: str, **fields: Any) -> Dict[str, Any]:
        with record.update(self.plan.name, self.home) as doc:
            doc["cells"][name].update(fields)
            return dict(doc["cells"][name])

    def _doc(self) -> Dict[str, Any]:
        doc = record.load(self.plan.name, self.home)
        assert doc is not None
        return doc

    def remediate(self) -> None:
        """Each cell the last reconcile found failed or unverified: a fresh run (a new name,
        the identical config); a missing one is continued under its own name. A missing cell
        this sweep saw succeed (it read its DONE.json in this store) whose run the store now
        holds no trace of: WrongStore before anything is deployed (``_untraced``)."""
        lost = [
            (n, str(c["run"])) for n, c in self._doc()["cells"].items()
            if c["state"] == "succeeded" and (c.get("verdict") or {}).get("verdict") == "missing"
        ]  # fmt: skip
        # DONE.json looked for too: a run that has it is not "nothing of it" (an agent older
        # than the epochs), and a store that has it again needs no re-run (``_next``).
        untraced = [n for n, run in lost if not self._traced(n, run) and not self._done(n, run)]
        if untraced:
            raise self._untraced(untraced)
        with record.update(self.plan.name, self.home) as doc:
            for name, c in doc["cells"].items():
                v = (c.get("verdict") or {}).get("verdict")
                if v in ("failed", "unverified"):
                    run = f"{name}-r{len(c['runs']) + 1}"
                    self.say(f"rgt sweep: {name}: {v} at the last reconcile; a fresh run {run}")
                    c.update(run=run, state="pending", verdict=None, error=None)
                elif v == "missing" and c["state"] == "succeeded":
                    c.update(state="pending", verdict=None)

    def _traced(self, name: str, run: str) -> bool:
        """Whether the store holds the run's epoch (sealed.py ``has_trace``); SweepStoreUnread
        when the store cannot say."""
        return self._ask(name, run, "whether it holds the run", lambda: has_trace(self.store, run))

    def _untraced(self, names: List[str]) -> WrongStore:
        """Cells the sweep saw succeed whose runs the store holds no trace of. Its result lost
        from the store would leave the run's epoch there (onbox/sealing/epochs.py: taken before
        its job starts, never removed by rgt); none at all is a store the boxes do not write
        to, as this laptop reaches it now. Deployed again, each cell's agent would find its
        DONE.json in the store it writes to and refuse to train it, until its box is left."""
        p = self.plan
        where = f"{p.store} at {p.store_endpoint}" if p.store_endpoint else str(p.store)
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        file_store = isinstance(self.store, LocalStore)
        return WrongStore(
            f"sweep {p.name}: the store {where} holds nothing of {len(names)} cell(s) this sweep "
            f"saw succeed: {shown}: no DONE.json, not even the epoch each run's agent takes "
            "there when it starts (RUN/epochs/); most likely it is not the store their boxes "
            f"write to ({wrong_store(file_store)}{', or a mount not there' if file_store else ''}"
            "), and nothing was deployed: each of their agents would refuse a run it finished",
            (
                "mount the store the boxes write to at that directory on this laptop"
                if file_store
                else "check that the endpoint and credentials this laptop uses reach the store "
                "the boxes write to"
            )
            + f"; then rgt reconcile {p.path}, and rgt sweep {p.path} again",
        )

    def _done(self, name: str, run: str) -> bool:
        """Whether the store holds the run's DONE.json, read as every store read is (retried
        past a blip); SweepStoreUnread when the store cannot say."""
        return self._ask(
            name,
            run,
            "whether it is sealed",
            lambda: with_retries(lambda: self.store.get_bytes(mf.done_key(run))) is not None,
        )

    def _ask(self, name: str, run: str, what: str, read: Callable[[], bool]) -> bool:
        """``read`` of the store (retried by it past a blip) about the cell ``name``;
        SweepStoreUnread, saying ``what`` could not be said, when the store cannot say."""
        try:
            with _STORE_READS:
                return read()
        except StoreError as e:
            raise SweepStoreUnread(
                f"sweep {self.plan.name}: cell {name} (run {run}): the store could not say "
                f"{what}: {e.what.rstrip('.')}; no box is to blame, and nothing "
                "more was deployed",
                (f"{e.remedy}; then " if e.remedy else "")
                + f"rgt sweep {self.plan.path} again resumes where it is",
            ) from None

    def _remote(self, box: Box) -> Remote:
        if box.remote is None:
            box.remote = open_remote(parse_target(box.target))
        return box.remote

    def _observe(self, box: Box, name: str, run: str) -> str:
        """done | failed | live | dead, for the run of a box's current cell."""
        if self._done(name, run):
            return "done"
        try:
            rec = self.registry.get(run)
        except NotFound:
            return "dead"  # deployed, but cut off before the record: deploy again
        st = boxrun.poll_status(rec, self._remote(box))
        state = st.get("state")
        alive = bool((st.get("agent") or {}).get("alive"))
        if state in ("FAILED", "STOPPED") and not alive:
            return "failed"
        if alive and (state in LIVE_NAMES or state == "SUCCEEDED"):
            return "live"  # SUCCEEDED and alive: the completion seal is on its way
        # The agent writes DONE.json before it lets go of the run: one that ended between the
        # look at the store above and the status (SUCCEEDED, its agent gone) is done, not dead.
        return "done" if self._done(name, run) else "dead"

    def _deploy(self, box: Box, name: str, run: str) -> None:
        from controller.deploy.flow import deploy
        from controller.deploy.request import DeployRequest

        p, cell = self.plan, self.cells[name]
        req = DeployRequest(
            target=box.target, command=deploy_command(cell), job_file=p.job_file,
            profile=p.profile, store=p.store, name=run, python=p.python,
            secret_env=p.secret_env, outputs=list(cell.outputs), offline=p.offline,
            project=p.project,
        )  # fmt: skip
        try:
            deploy(req, registry=self.registry, say=labelled_say(f"  [{box.target}] ", self.say))
        except LockedError as e:  # live on the box already (an older release): follow it
            self.say(f"rgt sweep: {name}: {e.what}; following it")
        with record.update(p.name, self.home) as doc:
            c = doc["cells"][name]
            if run not in c["runs"]:
                c["runs"].append(run)
            c.update(state="running", error=None, deployed_at=time.time())

    def _deploy_recorded(self, box: Box, name: str, run: str) -> None:
        """``_deploy``, a first one or one again after its agent was gone: its error recorded
        on the cell (so the sweep record says why it did not go on) and said, then raised for
        ``step``."""
        try:
            self._deploy(box, name, run)
        except RgtError as e:
            self._set(name, error=e.line())
            # Said as it happens: the summary says only a box's last error, once it is left.
            self.say(f"rgt sweep: {name}: its deploy to {box.target} failed (run {run}): {e.what}")
            raise

    def step(self, box: Box) -> bool:
        """One poll of ``box``: follow its current cell, deploy its next; whether it has
        work left."""
        doc = self._doc()
        cells = doc["cells"]
        names = record.queue(doc, box.target)
        current = next((n for n in names if cells[n]["state"] == "running"), None)
        try:
            if current is not None:
                run = cells[current]["run"]
                seen = self._observe(box, current, run)
                box.misses = 0
                if seen == "live":
                    return True
                if seen == "done":
                    self._set(current, state="succeeded")
                    self.say(f"rgt sweep: {current} succeeded on {box.target} (run {run})")
                elif seen == "failed":
                    self._set(current, state="failed")
                    self.say(f"rgt sweep: {current} FAILED on {box.target} (run {run})")
                else:
                    box.redeploys += 1
                    if box.redeploys > MAX_REDEPLOYS:
                        box.left = _redeploys_left(current, box.redeploys, cells[current])
                        return False
                    self.say(
                        f"rgt sweep: {current}'s agent on {box.target} is gone mid-cell: "
                        "deploying it again (it resumes from its newest sealed checkpoint)"
                    )
                    self._deploy_recorded(box, current, run)
                    return True
            return self._next(box, names, cells)
        except RemoteUnreachable as e:
            box.misses += 1
            box.remote = None
            if box.misses >= MAX_MISSES:
                box.left = f"it did not answer {box.misses} times: {e.what}"
                return False
            return True
        except (StoreHung, SweepStoreUnread):  # the sweep's store, not the box: every queue
            raise  # waits on it
        except RgtError as e:  # the box cannot take a deploy: its queue waits for a re-run
            # A store error from a deploy (exit 14) is the box's agent refusing to start: its
            # preflight, after its own retries, could not reach or write the store from the
            # box. That is the box's (its network, its credentials, its mount), not the cell's:
            # every cell of its queue would meet it alike, and the laptop read the same store
            # just before (``_done``). So the box is left, its cells pending for `rgt sweep`
            # again; none is marked failed, which would blame a job that never ran and make
            # reconcile launch a fresh run of it.
            box.left = e.line()
            return False

    def _next(self, box: Box, names: List[str], cells: Dict[str, Dict[str, Any]]) -> bool:
        for name in names:
            c = cells[name]
            if c["state"] != "pending":
                continue
            run = str(c["run"])
            if self._done(name, run):  # sealed already (a record lost or a finished deploy)
                self._set(name, state="succeeded")
                self.say(f"rgt sweep: {name} is sealed already (DONE.json): skipped")
                continue
            self.say(f"rgt sweep: {name} -> {box.target} (run {run})")
            self._deploy_recorded(box, name, run)
            return True
        return False

    def close(self) -> None:
        for b in self.boxes:
            if b.remote is not None:
                b.remote.close()

    def drive(self, wait: bool) -> int:
        """Every box's queue at once, each in its own thread (``_queue``), at most MAX_AT_ONCE
        boxes polled or deployed to at a time; the summary's exit code once all are done. An
        error that ends the sweep (its store unread, its record unreadable) stops the others
        after the step each is in (a deploy in flight is not cut off), then is raised; so is a
        Ctrl-C, once the steps in flight ended (a second one stops them: children.stop_all)."""
        gate = threading.BoundedSemaphore(MAX_AT_ONCE)
        stop = threading.Event()
        ended: List[BaseException] = []
        done: List[Box] = []
        for i, b in enumerate(self.boxes):
            threading.Thread(
                target=self._queue, args=(b, wait, gate, stop, ended, done),
                name=f"rgt-sweep-{i}", daemon=True,
            ).start()  # fmt: skip
        try:
            _until_all(done, len(self.boxes))
        except KeyboardInterrupt:
            stop.set()
            if len(done) < len(self.boxes):
                self.say(
                    "rgt sweep: interrupted: waiting for the deploys in flight to end (Ctrl-C "
                    f"again leaves them cut off; rgt sweep {self.plan.path} sorts them out)"
                )
                try:
                    _until_all(done, len(self.boxes))
                except KeyboardInterrupt:  # again: the deploys in flight are left, as said
                    children.stop_all()  # (their processes are out of the terminal's reach)
                    raise
            raise
        if ended:
            raise ended[0]
        return self.summary(wait)

    def _queue(
        self,
        box: Box,
        wait: bool,
        gate: threading.BoundedSemaphore,
        stop: threading.Event,
        ended: List[BaseException],
        done: List[Box],
    ) -> None:
        """One box's queue (a thread of ``drive``): ``step`` until it has no work left (once,
        without ``wait``), ``interval`` apart, within ``gate``; an error that ends the sweep
        is kept in ``ended`` and sets ``stop`` for every queue; ``box`` in ``done`` at its end."""
        try:
            with terminal.labelled(f"  [{box.target}] "):
                while not stop.is_set():
                    with gate:
                        more = not stop.is_set() and self.step(box)
                    if not more or not wait:
                        return
                    stop.wait(self.interval)
        except BaseException as e:  # raised by drive, in the main thread
            ended.append(e)
            stop.set()
        finally:
            done.append(box)

    def summary(self, wait: bool) -> int:
        cells = self._doc()["cells"]
        by: Dict[str, List[str]] = {s: [] for s in record.STATES}
        for n, c in cells.items():
            by[c["state"]].append(n)
        self.say(
            f"rgt sweep {self.plan.name}: {len(by['succeeded'])} succeeded, {len(by['failed'])} "
            f"failed, {len(by['running'])} running, {len(by['pending'])} pending "
            f"of {len(cells)}"
        )
        for b in self.boxes:
            if b.left:
                self.say(f"  {b.target}: its queue is left: {b.left}")
        if not wait:
            self.say(f"  follow it with: rgt sweep {self.plan.path} (it resumes where it is)")
            return 0
        if any(b.left for b in self.boxes) and (by["pending"] or by["running"]):
            self.say(f"  rgt sweep {self.plan.path} again resumes them")
            return RemoteUnreachable.exit_code
        if by["failed"]:
            self.say(f"  rgt reconcile {self.plan.path}, then rgt sweep it to re-run them")
            return FINAL_EXIT_CODES["FAILED"]
        self.say(f"  next: rgt reconcile {self.plan.path}")
        return 0


def sweep(
    plan: Plan,
    *,
    dry_run: bool = False,
    wait: bool = True,
    interval: float = 3.0,
    say: Say = _say,
    home: Optional[str] = None,
) -> int:
    """``rgt sweep`` (module docstring); the exit code."""
    if dry_run:
        show_plan(plan, say)
        return 0
    if plan.slurm:
        try:  # helper module of the Slurm wing (controller/slurm/array.py)
            submit = importlib.import_module("controller.slurm.array").submit_array
        except (ImportError, AttributeError):
            raise UsageError(
                "slurm",
                "this rgt cannot submit a sweep as a Slurm job array yet",
                "list the boxes in targets = [...] instead",
            ) from None
        record.begin(plan, home)
        result = submit(plan, say)
        record.submitted(plan, result["cells"], home)
        say(f"rgt: follow the cells with `rgt status CELL`; `rgt reconcile {plan.path}` when done")
        return 0
    check_store_here(plan)
    with record.driving(plan.name, home):
        record.begin(plan, home)
        driver = Driver(plan, say, interval, home)
        try:
            driver.remediate()
            return driver.drive(wait)
        finally:
            driver.close()
