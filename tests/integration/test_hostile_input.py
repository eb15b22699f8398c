"""The hostile-input table: every bad input to ``rgt-agent`` and to ``rgt`` is refused with one
line that names what was wrong, with the exit code of its kind (README, "Exit codes"), and
creates nothing.

One parametrised test per CLI, one row per input: the real CLI as a process, its argv (with
``{tmp}`` standing for the row's own directory) and environment, the exit code, a piece of the
message, and a snapshot of every tree the command could write to (for rgt-agent: RGT_HOME, the
working directory; for rgt: the controller home, the `local` box's home RGT_BOX_HOME, the
project, the working directory) taken before and after, which must be equal: no runs/N, no
registry entry, nothing on the box, no file changed (a corrupt registry stays byte for byte).

The inputs come from the list of bad inputs in the project's reliability notes (run names,
durations, store URLs, commands, job files, hosts, missing and corrupt runs).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from onbox.agent import procfs
from tests.conftest import Cli
from tests.laptop import rgt_exe

# --- the trees a command could write to --------------------------------------------------------

Snapshot = Dict[str, Tuple[str, str]]


def _snapshot(*roots: str) -> Snapshot:
    """Every path under ``roots`` -> (kind and mode, sha256 or link target)."""
    out: Snapshot = {}
    for root in roots:
        if not os.path.lexists(root):
            continue
        out[root] = ("dir" if os.path.isdir(root) else "other", "")
        for here, dirs, files in os.walk(root):
            for name in dirs + files:
                path = os.path.join(here, name)
                st = os.lstat(path)
                mode = oct(st.st_mode)
                if os.path.islink(path):
                    out[path] = (mode, os.readlink(path))
                elif os.path.isfile(path):
                    with open(path, "rb") as f:
                        out[path] = (mode, hashlib.sha256(f.read()).hexdigest())
                else:
                    out[path] = (mode, "")
    return out


def _no_processes_of(home: str) -> bool:
    key = home.encode()
    for pid in procfs.pids():
        env = procfs.environ(pid) if pid != os.getpid() else None
        if env and (env.get(b"RGT_HOME") == key or env.get(b"RGT_BOX_HOME") == key):
            return False
    return True


def _fill(value: str, tmp: str) -> str:
    return value.replace("{tmp}", tmp)


def _assert_one_line(p: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr  # one line, never a traceback
    assert needle in lines[0], (needle, lines[0])
    assert lines[0].startswith("rgt: "), lines[0]


# --- rgt-agent ---------------------------------------------------------------------------------

LONG = "a" * 300
AGENT_ROWS: List[Any] = [
    # run names: refused against the documented pattern, which the message shows
    *[
        pytest.param(["start", f"--name={n}", "--", "true"], 2, "[a-z0-9]", id=f"name-{i}")
        for i, n in enumerate(["", "..", "a/b", LONG, "a;b", "   ", "UPPER", "-rf", "$(reboot)"])
    ],
    pytest.param(["start", "{tmp}/badname.toml"], 2, "name: '../x'", id="name-in-job-file"),
    pytest.param(["start", "--name="], 2, "--name: ''", id="name-empty-no-command"),
    # durations
    *[
        pytest.param(["start", "--name", "x", "--grace", g, "--", "true"], 2, "--grace", id=i)
        for i, g in [
            ("grace-neg", "-5"),
            ("grace-nan", "NaN"),
            ("grace-inf", "inf"),
            ("grace-1e12", "1e12"),
            ("grace-5x", "5x"),
            ("grace-empty", ""),
            ("grace-words", "soon"),
        ]
    ],
    pytest.param(["start", "{tmp}/scan0.toml"], 2, "checkpoint.scan: must be greater", id="dur-0"),
    pytest.param(["start", "{tmp}/scannan.toml"], 2, "checkpoint.scan", id="dur-toml-nan"),
    pytest.param(["start", "{tmp}/scaninf.toml"], 2, "checkpoint.scan", id="dur-toml-inf"),
    pytest.param(["start", "{tmp}/backoff.toml"], 2, "restart.backoff_max", id="dur-toml-neg"),
    # store URLs: parsed before anything is made, the accepted forms named
    *[
        pytest.param(["start", "--name", "x", "--store", u, "--", "true"], 2, want, id=i)
        for i, u, want in [
            ("store-one-slash", "s3:/bucket", "is not a store URL"),
            ("store-no-bucket", "s3://", "names no bucket"),
            ("store-bad-bucket", "s3://Bad_Bucket", "not a valid S3 bucket name"),
            ("store-dotdot-key", "s3://bucket/a/../b", "may not hold '.' or '..'"),
            ("store-ftp", "ftp://x", "use file://, s3:// or hf://"),
            ("store-file-relative", "file://relative", "three slashes"),
            ("store-file-dotdot", "file:///x/../y", "may not hold '..'"),
            ("store-file-nul", "file:///x%00y", "NUL"),
            ("store-hf-no-repo", "hf://user", "names no Hub repo"),
            ("store-empty", "", "is not a store URL"),
        ]
    ],
    pytest.param(["start", "{tmp}/ftpstore.toml"], 2, "store: 'ftp://x'", id="store-in-job"),
    # a store that refuses its preflight: exit 14, and no runs/N left behind
    pytest.param(
        ["start", "--name", "x", "--store", "file://{tmp}/afile", "--", "true"],
        14,
        "store preflight failed",
        id="store-preflight-fails",
    ),
    # commands
    pytest.param(["start", "--name", "x", "--"], 2, "command: is empty", id="cmd-none"),
    pytest.param(["start", "--name", "x"], 2, "command: is empty", id="cmd-missing"),
    pytest.param(["start", "--name", "x", "--", ""], 2, "command: is empty", id="cmd-empty"),
    pytest.param(["start", "--name", "x", "--", " "], 2, "command: is empty", id="cmd-blank"),
    pytest.param(
        ["start", "--name", "x", "--", "no-such-program-rgt"], 2, "not found on PATH", id="cmd-path"
    ),
    pytest.param(
        ["start", "--name", "x", "--", "./no-such-file"], 2, "not an executable", id="cmd-file"
    ),
    pytest.param(["start", "{tmp}/cmdstr.toml"], 2, "must be a list of strings", id="cmd-string"),
    pytest.param(["start", "python", "train.py"], 2, "train.py", id="cmd-without-dashes"),
    pytest.param(["run", "--name", "x"], 2, "command: is empty", id="run-cmd-missing"),
    # checkpoint directories that cannot be made or written: exit 9, nothing left behind
    pytest.param(
        ["start", "--name", "x", "--ckpt-dir", "{tmp}/afile/ckpt", "--", "true"],
        9,
        "is not a directory",
        id="ckpt-under-a-file",
    ),
    pytest.param(
        ["start", "--name", "x", "--ckpt-dir", "/proc/rgt-no-such/ckpt", "--", "true"],
        9,
        "checkpoint dir /proc/rgt-no-such/ckpt is not writable",
        id="ckpt-in-proc",
    ),
    pytest.param(
        ["run", "--name", "x", "--ckpt-dir", "/proc/rgt-no-such/ckpt", "--", "true"],
        9,
        "is not writable",
        id="run-ckpt-in-proc",
    ),
    # RGT_HOME that cannot hold runs
    pytest.param(
        ["start", "--name", "x", "--", "true"],
        9,
        "set RGT_HOME",
        {"RGT_HOME": "{tmp}/afile"},
        id="home-is-a-file",
    ),
    pytest.param(
        ["start", "--name", "x", "--", "true"],
        9,
        "set RGT_HOME",
        {"RGT_HOME": "/proc/rgt-no-such/home"},
        id="home-in-proc",
    ),
    # job files
    pytest.param(["start", "{tmp}/unknown.toml"], 2, "bogus: unknown setting", id="job-key"),
    pytest.param(["start", "{tmp}/unknown2.toml"], 2, "checkpoint.dri", id="job-section-key"),
    pytest.param(["start", "{tmp}/nottoml.toml"], 2, "JOB.toml", id="job-not-toml"),
    pytest.param(["start", "{tmp}/missing.toml"], 2, "does not exist", id="job-missing"),
    pytest.param(["start", "nope.toml", "--", "true"], 2, "JOB.toml", id="job-and-command"),
    # flags
    pytest.param(["start", "--nmae", "x", "--", "true"], 2, "--nmae", id="flag-unknown"),
    # reading a store: a missing one is not "no checkpoints yet"
    pytest.param(
        ["checkpoints", "--store", "file://{tmp}/no-store", "--name", "x"],
        8,
        "does not exist",
        id="checkpoints-missing-store",
    ),
    pytest.param(
        ["checkpoints", "--store", "file://{tmp}/empty-store/x"],
        8,
        "holds no run 'x'",
        id="checkpoints-missing-run",
    ),
    pytest.param(
        ["checkpoints", "--store", "file:///nonexistent"],
        8,
        "holds no run 'nonexistent'",
        id="checkpoints-file-nonexistent",
    ),
    pytest.param(
        ["checkpoints", "--store", "file://{tmp}/no-store", "--name", "x", "--json"],
        8,
        "does not exist",
        id="checkpoints-json-missing-store",
    ),
    pytest.param(
        ["checkpoints", "--store", "ftp://x", "--name", "x"], 2, "unknown scheme", id="ckpts-ftp"
    ),
    pytest.param(
        ["checkpoints", "--store", "file://{tmp}/empty-store", "--name", ".."],
        2,
        "--name",
        id="checkpoints-bad-name",
    ),
    # runs that do not exist
    *[
        pytest.param(argv, 8, "no run named 'nope'", id=f"missing-{argv[0]}")
        for argv in (["status", "nope"], ["logs", "nope"], ["stop", "nope"], ["sync", "nope"])
    ],
]

JOB_FILES = {
    "badname.toml": 'name = "../x"\ncommand = ["true"]\n',
    "scan0.toml": 'command = ["true"]\n[checkpoint]\nscan = 0\n',
    "scannan.toml": 'command = ["true"]\n[checkpoint]\nscan = nan\n',
    "scaninf.toml": 'command = ["true"]\n[checkpoint]\nscan = inf\n',
    "backoff.toml": 'command = ["true"]\n[restart]\nbackoff_max = "-5s"\n',
    "ftpstore.toml": 'command = ["true"]\nstore = "ftp://x"\n',
    "cmdstr.toml": 'command = "python train.py"\n',
    "unknown.toml": 'name = "x"\ncommand = ["true"]\nbogus = 1\n',
    "unknown2.toml": 'command = ["true"]\n[checkpoint]\ndri = "x"\n',
    "nottoml.toml": "this is not [[[ toml\n",
}


def _agent_sandbox(tmp: Path) -> None:
    for name, text in JOB_FILES.items():
        (tmp / name).write_text(text)
    (tmp / "afile").write_text("a regular file, where a directory is expected\n")
    (tmp / "empty-store").mkdir()


def _rows(rows: List[Any]) -> List[Any]:
    """Rows as (argv, code, needle, env): a row without an environment of its own gets {}."""
    return [
        pytest.param(*r.values, *([{}] if len(r.values) == 3 else []), id=r.id, marks=r.marks)
        for r in rows
    ]


@pytest.mark.parametrize("argv,code,needle,env", _rows(AGENT_ROWS))
def test_rgt_agent_refuses_hostile_input_and_creates_nothing(
    cli: Cli, tmp_path: Path, argv: List[str], code: int, needle: str, env: Dict[str, str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    _agent_sandbox(work)
    tmp = str(work)
    for k, v in env.items():
        cli.env[k] = _fill(v, tmp)
    home = cli.env["RGT_HOME"]
    absent = [p for p in ("/nonexistent", "/proc/rgt-no-such") if not os.path.lexists(p)]
    before = _snapshot(cli.home, home, tmp)
    p = cli(*[_fill(a, tmp) for a in argv], cwd=tmp)
    _assert_one_line(p, code, _fill(needle, tmp))
    assert _snapshot(cli.home, home, tmp) == before
    assert not os.path.exists(os.path.join(cli.home, "runs"))
    assert [p for p in absent if os.path.lexists(p)] == []
    assert _no_processes_of(home)


# --- rgt ---------------------------------------------------------------------------------------

CORRUPT = {
    "not-json": b'{"runs": {"x": ',
    "not-utf8": b"\xff\xfe{}",
    "runs-a-list": b'{"runs": []}',
    "a-list": b"[]",
    "record-malformed": b'{"runs": {"x": {"name": "x"}}}',
}

RGT_ROWS: List[Any] = [
    # hosts: ssh option injection, malformed destinations
    pytest.param(
        ["deploy", "-oProxyCommand=touch {tmp}/pwned", "--name", "x", "--", "true"],
        2,
        "No such option",
        id="host-dash-option",
    ),
    pytest.param(
        ["deploy", "--name", "x", "--", "-oProxyCommand=touch {tmp}/pwned"],
        2,
        "Missing argument 'TARGET'",
        id="host-dash-after-dashdash",
    ),
    pytest.param(
        ["deploy", "ssh -oProxyCommand='touch {tmp}/pwned' u@h", "--name", "x", "--", "true"],
        2,
        "TARGET",
        id="host-pasted-proxycommand",
    ),
    pytest.param(
        ["deploy", "u@-oProxyCommand=sh", "--name", "x", "--", "true"],
        2,
        "TARGET",
        id="host-at-dash",
    ),
    pytest.param(["deploy", "user@@host", "--name", "x", "--", "true"], 2, "TARGET", id="host-@@"),
    pytest.param(["deploy", "host:99999", "--name", "x", "--", "true"], 2, "port", id="host-port"),
    pytest.param(["deploy", "host:0", "--name", "x", "--", "true"], 2, "port", id="host-port-0"),
    pytest.param(["deploy", "", "--name", "x", "--", "true"], 2, "TARGET", id="host-empty"),
    # store URLs, checked on the laptop before the push and the install
    *[
        pytest.param(["deploy", "local", "--name", "x", "--store", u, "--", "true"], 2, w, id=i)
        for i, u, w in [
            ("store-ftp", "ftp://x", "--store: 'ftp://x': unknown scheme 'ftp' (use file://"),
            ("store-bad-bucket", "s3://Bad_Bucket", "--store: 'Bad_Bucket'"),
            ("store-no-bucket", "s3://", "--store: 's3://' names no bucket"),
            ("store-file-relative", "file://relative", "--store"),
            ("store-hf-no-repo", "hf://user", "--store"),
            ("store-not-url", "bucket", "--store: 'bucket' is not a store URL"),
        ]
    ],
    pytest.param(
        ["deploy", "local", "project/ftp.toml", "--project", "project"],
        2,
        "project/ftp.toml: store: 'ftp://x'",
        id="store-in-job-file",
    ),
    # run names
    *[
        pytest.param(["deploy", "local", f"--name={n}", "--", "true"], 2, "--name", id=f"name-{i}")
        for i, n in enumerate(["", "..", "../x", "a/b", LONG, "a;b", "UPPER", "   "])
    ],
    # other deploy input
    # (with --name alone it starts run x again from the box's record: test_deploy_again.py)
    pytest.param(["deploy", "local"], 2, "command: nothing to run", id="no-cmd"),
    pytest.param(
        ["deploy", "local", "--name", "x", "--profile", "aws", "--", "true"],
        2,
        "--profile",
        id="profile-unknown",
    ),
    pytest.param(
        ["deploy", "local", "--name", "x", "--secret-env", "RGT_TEST_UNSET_VAR", "--", "true"],
        2,
        "RGT_TEST_UNSET_VAR is not set",
        id="secret-unset",
    ),
    pytest.param(
        ["deploy", "local", "--name", "x", "--secret-env", "A-B", "--", "true"],
        2,
        "--secret-env",
        id="secret-bad-name",
    ),
    pytest.param(
        ["deploy", "local", "--name", "x", "--project", "{tmp}/no-project", "--", "true"],
        2,
        "project",
        id="project-missing",
    ),
    pytest.param(
        ["deploy", "local", "{tmp}/outside.toml", "--project", "project"],
        2,
        "is not inside the project",
        id="job-file-outside-project",
    ),
    # runs this laptop does not know
    *[
        pytest.param(argv, 8, "no run named 'nope'", id=f"missing-{argv[0]}")
        for argv in (
            ["status", "nope"],
            ["status", "nope", "--json"],
            ["watch", "nope", "--once"],
            ["logs", "nope"],
            ["stop", "nope"],
            ["pull", "nope"],
            ["down", "nope", "--yes"],
        )
    ],
    pytest.param(["status"], 2, "no runs deployed", id="status-no-runs"),
    pytest.param(["pull", "x", "--from", "ftp"], 2, "--from", id="pull-bad-source"),
    # a corrupt registry is reported as what it is, for every command, and left as it is
    *[
        pytest.param(
            argv,
            6,
            "the run registry {ctl}/runs.json is corrupt",
            kind,
            id=f"corrupt-{kind}-{argv[0]}",
        )
        for kind in CORRUPT
        for argv in (["status", "x"], ["runs"], ["pull", "x"], ["down", "x", "--yes"])
    ],
    *[
        pytest.param(
            ["deploy", "local", "--name", "x", "--project", "project", "--", "true"],
            6,
            "the run registry {ctl}/runs.json is corrupt",
            kind,
            id=f"corrupt-{kind}-deploy",
        )
        for kind in ("not-json", "record-malformed")
    ],
]


@pytest.mark.parametrize(
    "argv,code,needle,registry",
    [
        pytest.param(*r.values, *([None] if len(r.values) == 3 else []), id=r.id, marks=r.marks)
        for r in RGT_ROWS
    ],
)
def test_rgt_refuses_hostile_input_and_creates_nothing(
    tmp_path: Path, argv: List[str], code: int, needle: str, registry: Optional[str]
) -> None:
    work = tmp_path / "work"
    ctl = tmp_path / "ctl"
    box = tmp_path / "box"
    project = work / "project"
    project.mkdir(parents=True)
    (project / "train.py").write_text("print('step 1')\n")
    (project / "ftp.toml").write_text('command = ["true"]\nstore = "ftp://x"\n')
    (work / "outside.toml").write_text('command = ["true"]\n')
    if registry is not None:  # the row's corrupt runs.json
        ctl.mkdir()
        (ctl / "runs.json").write_bytes(CORRUPT[registry])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    env.update(
        RGT_CONTROLLER_HOME=str(ctl),
        RGT_BOX_HOME=str(box),
        RGT_SSH_CONFIG="/dev/null",
        RGT_SSH_CONNECT_TIMEOUT="5",
    )
    tmp = str(work)
    before = _snapshot(str(ctl), str(box), tmp)
    p = subprocess.run(
        [*rgt_exe(), *[_fill(a, tmp) for a in argv]],
        env=env,
        cwd=tmp,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_one_line(p, code, needle.replace("{ctl}", str(ctl)))
    assert _snapshot(str(ctl), str(box), tmp) == before
    assert not box.exists()  # nothing on the box: not even its home
    assert not (work / "pwned").exists()
    assert _no_processes_of(str(box))
