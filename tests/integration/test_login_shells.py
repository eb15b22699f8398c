"""Remote commands arrive byte for byte whatever the login shell of the box's user is.

sshd runs every command through the user's login shell, and rentals ship bash, dash, zsh and
fish (which reads backslashes in single quotes its own way), some tcsh. For each of them a real
user of a real sshd on loopback (tests/sshd.py ``shell_user``) with that login shell, reached
through ``SshRemote`` as rgt reaches a box. Covered, for every shell:

- ``run``: an argv of quotes, ``;``, ``$(...)``, backticks, newlines, backslashes (``a\\`` next to
  ``; touch X``, the argv that made fish run ``touch`` before), globs, ``~``, ``$HOME``, ``%``,
  ``!``, ``#``, unicode, bytes that are not UTF-8, a leading ``-`` and the empty string comes
  back exactly (``printf '%s\\0'``) and no planted file is created;
- ``sh``: the same as ``$1...``, with hostile ``env=`` values, and stdin still carrying data;
- ``popen``, and the line ``rgt deploy`` starts the agent with (``cd DIR; exec "$@"``), the job's
  argv as a Python on the box sees it;
- a release pushed with rsync (whose remote command rsync builds: ``-s`` keeps it to option
  letters) and with tar, files with hostile names arriving byte for byte;
- a box without /bin/sh: HostError (exit 9) naming it, whatever shell says so;
- a pull from a box without rsync (its PATH has none: the sshd's SetEnv) streams the files
  instead, whatever shell says rsync is missing.

Under CI=true a missing shell fails (tests/conftest.py ``require``); scripts/check installs them.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from controller import remote as remotemod
from controller.deploy.boxstart import START_SH, failure_words
from controller.deploy.release import push_release
from controller.remote import SshRemote
from controller.results.entries import Entry, Sealed
from controller.results.receipt import SealedId
from controller.results.transport import fetcher
from controller.target import Target
from onbox.common.errors import HostError
from tests.conftest import require
from tests.sshd import LOGIN_SHELLS, SshServer, missing, shell_missing, shell_user, start_sshd

SHELLS = list(LOGIN_SHELLS)  # bash, dash, zsh, fish, tcsh
BOX_PYTHON = "/usr/bin/python3"  # the shell users cannot reach root's venv (/root is 0700)


def hostile(plant: str) -> List[str]:
    """Arguments a login shell, sh, printf or an option parser could get wrong. Each that would
    run a command plants a file under ``plant`` (absolute, so it shows wherever the shell ran)."""
    p = plant
    return [
        "'", '"', "it's", 'say "hi"', "'\\''", "\\'", '\\"',
        ";", f"a; touch {p}/semi", f"$(touch {p}/dollar)", f"`touch {p}/backtick`",
        # fish: a backslash before a closing quote escapes it, so what follows was code.
        "a\\", f"; touch {p}/fish ; #", f"a\\ ; touch {p}/fish2 ; ", "\\",
        "line1\nline2", "\n", "trailing\n\n", "\r", "tab\there",
        "back\\slash", "\\n", "\\012", "\\$HOME", "\\\\",
        "*", "?", "[a-z]", "{a,b}", "~", "~root", "$HOME", "${HOME}", "$$", "$0", "$1", "$@",
        "%", "%s%d%n", "%self", "!", "!!", "!$", "#", "# comment", "&", f"| touch {p}/pipe",
        f">{p}/redir", "<", "(", ")", "^", "a=b", "$(", "`",
        "ünïcödé ☃ 中文", os.fsdecode(b"latin1-\xff\xfe"),
        "-n", "-e", "--", "-oProxyCommand=touch x", "",  " ",
    ]  # fmt: skip


def nul_joined(args: List[str]) -> bytes:
    return b"".join(os.fsencode(a) + b"\0" for a in args)


@pytest.fixture(scope="module")
def shell_sshd(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Tuple[SshServer, Dict[str, str]]]:
    """One sshd whose client key logs in as a user of each login shell this machine has."""
    why = missing()
    require(why is None, why or "")
    users = {name: shell_user(name) for name in SHELLS if shell_missing(name) is None}
    server = start_sshd(str(tmp_path_factory.mktemp("shells-sshd")), users=list(users.values()))
    try:
        yield server, users
    finally:
        server.stop()


class Box:
    """One login shell's user on the test sshd, as rgt reaches it, and a directory of theirs
    (owned by them, so whatever a hostile argument made the shell do would land there)."""

    def __init__(self, shell: str, user: str, remote: SshRemote, work: str) -> None:
        self.shell = shell
        self.user = user
        self.remote = remote
        self.work = work
        self.plant = os.path.join(work, "plant")
        self.home = pwd.getpwnam(user).pw_dir

    def planted(self) -> List[str]:
        """Files a hostile argument made: in the plant directory, or in the user's home (where a
        relative path would land) under a name one of them uses."""
        found = sorted(os.listdir(self.plant))
        found += [n for n in ("x", "pwned") if os.path.exists(os.path.join(self.home, n))]
        return found


@pytest.fixture(params=SHELLS)
def box(
    request: pytest.FixtureRequest,
    shell_sshd: Tuple[SshServer, Dict[str, str]],
    controller_env: Dict[str, str],
) -> Iterator[Box]:
    shell: str = request.param
    why = shell_missing(shell)
    require(why is None, why or "")
    server, users = shell_sshd
    user = users[shell]
    pw = pwd.getpwnam(user)
    work = tempfile.mkdtemp(prefix=f"rgt-shell-{shell}-", dir="/tmp")
    os.makedirs(os.path.join(work, "plant"))
    for d in (work, os.path.join(work, "plant")):
        os.chown(d, pw.pw_uid, pw.pw_gid)
    remote = SshRemote(
        Target("ssh", host=server.host, port=server.port, user=user, identity=server.client_key)
    )
    try:
        r = remote.run(["true"], timeout=60)  # the first login also records the host key
        assert r.rc == 0, f"{user}: {r.err}\nsshd log:\n{server.log()[-3000:]}"
        yield Box(shell, user, remote, work)
    finally:
        remote.close()
        shutil.rmtree(work, ignore_errors=True)


def test_login_shell_is_the_one_tested(
    box: Box, shell_sshd: Tuple[SshServer, Dict[str, str]]
) -> None:
    """sshd really runs the shell under test: a plain ssh command line (not rgt's), whose
    program's parent is the shell (``; true`` after it, so no shell execs it in its place)."""
    assert pwd.getpwnam(box.user).pw_shell == LOGIN_SHELLS[box.shell]
    server = shell_sshd[0].as_user(box.user)
    line = (
        f"{BOX_PYTHON} -c \"import os; print(open('/proc/%d/comm' % os.getppid()).read())\"; true"
    )
    p = server.run(line)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == os.path.basename(LOGIN_SHELLS[box.shell])


def test_run_argv_byte_for_byte(box: Box) -> None:
    args = hostile(box.plant)
    r = box.remote.run(["printf", "%s\\0", *args], timeout=60)
    assert r.rc == 0, r.err
    assert r.stdout == nul_joined(args)
    assert r.stderr == b""
    assert box.planted() == []


def test_run_argv_alone(box: Box) -> None:
    """Each argument on its own, the last of the line (no neighbour to pair with)."""
    for a in hostile(box.plant):
        r = box.remote.run(["printf", "%s\\0", a], timeout=60)
        assert (r.rc, r.stdout) == (0, nul_joined([a])), (a, r.err)
    assert box.planted() == []


def test_sh_args_env_and_stdin(box: Box) -> None:
    """``Remote.sh``: hostile $1..., hostile env values, and stdin still the caller's data."""
    args = hostile(box.plant)
    env = {"RGT_T_A": "it's $(touch x) `x` \\ ; #", "RGT_T_B": "line\nbreak\\", "RGT_T_C": ""}
    data = bytes(range(256)) * 64 + b"\0end"
    script = 'printf "%s\\0" "$0" "$#" "$@" "$RGT_T_A" "$RGT_T_B" "${RGT_T_C-unset}"; exec cat'
    r = box.remote.sh(script, *args, env=env, input=data, timeout=60)
    assert r.rc == 0, r.err
    expect = nul_joined(["rgt", str(len(args)), *args, *env.values()]) + data
    assert r.stdout == expect
    assert box.planted() == []


def test_exit_status_and_stderr_pass_through(box: Box) -> None:
    r = box.remote.sh('printf "%s" "$1" >&2; exit 42', "it's ; `x`")
    assert (r.rc, r.stderr, r.stdout) == (42, b"it's ; `x`", b"")


def test_popen(box: Box) -> None:
    args = hostile(box.plant)
    p = box.remote.popen(["printf", "%s\\0", *args], env={"RGT_T": "a'b"})
    assert p.stdout is not None
    try:
        out = p.stdout.read()
    finally:
        p.stdout.close()
        rc = p.wait(60)
    assert (rc, out) == (0, nul_joined(args))
    assert box.planted() == []


def test_deploy_start_line_job_argv(box: Box) -> None:
    """The line controller/deploy/boxstart.py starts the agent with (``START_SH``), with
    ``env K=V`` and a job after ``--``: the job (a Python on the box) sees its argv as given."""
    args = hostile(box.plant)
    job = (
        "import json, os, sys; "
        "print(json.dumps([os.getcwd(), os.environ['RGT_HOME'], sys.argv[1:]]))"
    )
    rgt_home = os.path.join(box.work, "home 'q' $(x)")
    r = box.remote.sh(
        START_SH,
        box.work,
        "",  # no staged secrets to remove
        os.path.join(rgt_home, "runs", "r"),  # the run's directory
        os.path.join(rgt_home, "deploys", "r"),  # its deploy's
        "",  # no release to remove if the start fails
        "env",
        f"RGT_HOME={rgt_home}",
        BOX_PYTHON,
        "-c",
        job,
        *args,
        timeout=60,
    )
    assert r.rc == 0, r.err
    cwd, home, argv = json.loads(r.stdout)
    assert (cwd, home) == (box.work, rgt_home)
    assert argv == args
    assert box.planted() == []


def test_deploy_start_line_says_what_it_left_after_a_failed_start(box: Box) -> None:
    """A start that exits non-zero: its code comes back as it was, its stdout whole, then the
    words of what the same command did after it (no release to drop, no run there, no current
    link), whatever the login shell; the paths travel as data."""
    home = os.path.join(box.work, "home 'q' $(x)")
    r = box.remote.sh(
        START_SH,
        box.work,
        "",
        os.path.join(home, "runs", "r"),
        os.path.join(home, "deploys", "r"),
        "",
        BOX_PYTHON,
        "-c",
        "import sys; print('agent out'); sys.exit(14)",
        timeout=60,
    )
    assert r.rc == 14, r.err
    assert failure_words(r.text) == ("agent out\n", ["-", "none", "-"]), r.text
    assert box.planted() == []


RELEASE_FILES = [
    "plain.py",
    "quote'single",
    'quote"double',
    "semi;colon $(touch x)",
    "`touch x`",
    "-leading-dash",
    "back\\slash a\\",
    "new\nline",
    "ünïcödé %s !x #",
    "dir with space/nested -x/file;1",
]


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_release_push(box: Box, tmp_path: Path, method: str) -> None:
    """A release with hostile file names into a hostile box home, pushed with rsync (whose own
    remote command runs through the login shell) and with tar (through ``Remote.argv``)."""
    require(shutil.which("rsync") is not None, "rsync on this machine")
    project = tmp_path / "project"
    for i, rel in enumerate(RELEASE_FILES):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_bytes(f"{i} {rel}\n".encode())
    box_home = os.path.join(box.work, "box 'home' $(touch x) \\ ; #")
    res = push_release(box.remote, str(project), box_home, method=method)
    assert res.method == method
    assert res.transferred_files == len(RELEASE_FILES)
    for i, rel in enumerate(RELEASE_FILES):
        with open(os.path.join(res.path, rel), "rb") as f:
            assert f.read() == f"{i} {rel}\n".encode(), rel
        assert os.stat(os.path.join(res.path, rel)).st_uid == pwd.getpwnam(box.user).pw_uid
    assert box.planted() == []
    assert not os.path.exists(os.path.join(box.work, "x"))


def test_missing_box_sh_is_a_host_error(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    """A box without /bin/sh: each login shell says so its own way; rgt names it (exit 9). The
    path is one that does not exist, as /bin/sh would not on such a box."""
    monkeypatch.setattr(remotemod, "BOX_SH", "/nonexistent/rgt-test/sh")
    with pytest.raises(HostError) as e:
        box.remote.run(["true"])
    assert e.value.exit_code == 9
    assert "has no /nonexistent/rgt-test/sh" in e.value.what, e.value.what
    # A command that itself is missing is the command's own status, not a missing shell.
    monkeypatch.setattr(remotemod, "BOX_SH", "/bin/sh")
    r = box.remote.run(["/nonexistent/rgt-test/cmd"])
    assert r.rc == 127


def test_line_has_nothing_a_shell_reads_in_single_quotes() -> None:
    """The fixed line: inside its single quotes only characters no shell treats specially there
    (no quote, no ! of csh, a backslash only before a digit), for any script."""
    script = "".join(map(chr, range(1, 0x80))) + "ünï" + os.fsdecode(b"\xff")
    line = remotemod.box_line(script)
    inner = line[line.index("'") + 1 : -1]
    assert "'" not in inner and "!" not in inner and "\n" not in inner
    assert all(inner[i + 1].isdigit() for i, c in enumerate(inner) if c == "\\")
    r = subprocess.run(["sh", "-c", inner.replace("eval", "printf %s", 1)], capture_output=True)
    assert r.stdout == os.fsencode(script)


@pytest.fixture(scope="module")
def no_rsync_sshd(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Tuple[SshServer, Dict[str, str]]]:
    """An sshd whose sessions have a PATH of sh and tail alone: a box without rsync."""
    why = missing()
    require(why is None, why or "")
    d = tmp_path_factory.mktemp("no-rsync")
    bin_dir = tempfile.mkdtemp(prefix="rgt-no-rsync-", dir="/tmp")  # the shell users can read it
    os.chmod(bin_dir, 0o755)
    for tool in ("sh", "tail"):
        os.symlink(shutil.which(tool) or tool, os.path.join(bin_dir, tool))
    users = {name: shell_user(name) for name in SHELLS if shell_missing(name) is None}
    server = start_sshd(str(d), users=list(users.values()), set_env={"PATH": bin_dir})
    try:
        yield server, users
    finally:
        server.stop()
        shutil.rmtree(bin_dir, ignore_errors=True)


@pytest.mark.parametrize("shell", SHELLS)
def test_pull_from_a_box_without_rsync_streams_the_files(
    shell: str,
    no_rsync_sshd: Tuple[SshServer, Dict[str, str]],
    controller_env: Dict[str, str],
    tmp_path: Path,
) -> None:
    """rsync's remote command goes through the login shell, which says a missing rsync in
    words of its own, and over ssh rsync exits 127 (not the 12 rgt read a missing rsync
    from): the pull ended "rsync failed (exit 127)", every time, instead of streaming the
    files with tail."""
    require(shutil.which("rsync") is not None, "rsync on this machine")
    require(shell_missing(shell) is None, shell_missing(shell) or "")
    server, users = no_rsync_sshd
    pw = pwd.getpwnam(users[shell])
    root = tempfile.mkdtemp(prefix=f"rgt-pull-{shell}-", dir="/tmp")
    files = {"step_1/model.bin": b"weights " * 1000, "step_1/it's $(x)": b"x\n"}
    for rel, data in files.items():
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    subprocess.run(["chown", "-R", f"{pw.pw_uid}:{pw.pw_gid}", root], check=True)
    entries = [
        Entry(f"checkpoints/{rel}", "checkpoint", len(data), "", None, rel, rel)
        for rel, data in files.items()
    ]
    remote = SshRemote(
        Target(
            "ssh", host=server.host, port=server.port, user=users[shell], identity=server.client_key
        )
    )
    stage = tmp_path / "stage"
    stage.mkdir()
    done: List[str] = []
    try:
        fetch = fetcher(
            Sealed(SealedId(), entries, "box", box_root=root),
            str(stage),
            None,
            None,
            remote,
            lambda e, sha256=None: done.append(e.path),
        )
        assert fetch(entries) == sum(map(len, files.values()))
    finally:
        remote.close()
        shutil.rmtree(root, ignore_errors=True)
    assert sorted(done) == sorted(e.path for e in entries)
    for rel, data in files.items():
        assert (stage / rel).read_bytes() == data
