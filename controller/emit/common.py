"""What every `rgt emit` target shares: the job file read the way the agent will read it, the
seal time the grace is derived from, the credential check on what goes out, a YAML writer for
the fixed shapes we emit, and the atomic write of the result.

The YAML writer is ours (about 40 lines) rather than PyYAML's: the laptop package does not gain
a dependency for two fixed shapes, and every string is written double-quoted with JSON's escapes
(a subset of YAML's), so no value can turn into another type or another key (``no``, ``1e3``,
``key: value`` inside a string). Multi-line strings become literal blocks, for readable scripts.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from typing import Any, List, Mapping, Optional

from onbox.agent.spec import JobSpec, Overrides, build_spec
from onbox.common.durable import write_atomic
from onbox.common.errors import UsageError

# The variable names whose values are credentials (the redactor's rule: onbox/common/redact.py).
_SECRET_NAME = re.compile(r"(?i)(TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY)")
_PATH_NAME = re.compile(r"(?i)_(FILE|PATH|DIR|HOME)$")


def is_credential_name(name: str) -> bool:
    """Whether a variable named ``name`` holds a secret (``*_TOKEN``, ``*SECRET*``...)."""
    return bool(_SECRET_NAME.search(name)) and not _PATH_NAME.search(name)


def load_job(job_file: str, flags: Overrides) -> JobSpec:
    """The job file checked exactly as ``rgt-agent run JOB.toml`` checks it on the box
    (onbox/agent/spec.py: unknown keys, names, the store URL, durations, the profile).

    Two things the laptop cannot see are taken on trust: the image's PATH (a bare command such
    as ``torchrun`` need not exist here; one with a ``/`` is still checked against the project)
    and the pod's run directory (a temporary one stands in)."""
    if not os.path.isfile(job_file):
        raise UsageError("JOB.toml", f"{job_file} does not exist", "give the job file's path")
    with tempfile.TemporaryDirectory(prefix="rgt-emit-") as tmp:
        # A stand-in for every bare command name, so `which` finds what the image will have.
        stubs = os.path.join(tmp, "bin")
        os.mkdir(stubs)
        environ = dict(os.environ, PATH=stubs + os.pathsep + os.environ.get("PATH", os.defpath))
        for name in _bare_commands(job_file, flags):
            stub = os.path.join(stubs, name)
            with open(stub, "w") as f:
                f.write("#!/bin/sh\n")
            os.chmod(stub, 0o755)
        return build_spec(
            job_file,
            flags,
            cwd=os.getcwd(),
            environ=environ,
            default_name="job",
            run_dir_of=lambda n: os.path.join(tmp, "runs", n),
        )


def _bare_commands(job_file: str, flags: Overrides) -> List[str]:
    """The command's first word when it has no ``/`` (looked up on the image's PATH)."""
    command: Any = flags.command
    if not command:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - older laptops
            import tomli as tomllib
        try:
            with open(job_file, "rb") as f:
                command = tomllib.load(f).get("command")
        except (OSError, ValueError):
            return []  # build_spec reports it
    if isinstance(command, list) and command and isinstance(command[0], str):
        word = command[0]
        if word and "/" not in word and word not in (".", "..") and "\0" not in word:
            return [word]
    return []


def job_file_credentials(spec: JobSpec) -> List[str]:
    """Names of the job file's ``[env]`` entries that hold credentials: never copied out, and
    the user is told to move them into a Secret."""
    return sorted(k for k in spec.env if is_credential_name(k))


def check_no_secret(text: str, spec: JobSpec, environ: Mapping[str, str]) -> None:
    """A last guard before anything is written: no credential value of the job file's
    ``[env]`` or of this laptop's environment appears in ``text``."""
    values = {v for k, v in spec.env.items() if is_credential_name(k)}
    values |= {v for k, v in environ.items() if is_credential_name(k)}
    for v in values:
        if len(v) >= 6 and v in text:  # shorter ones occur by chance (the redactor's rule)
            raise AssertionError("a credential value reached the emitted text")  # a bug of ours


def warn(text: str) -> None:
    print(f"rgt: {text}", file=sys.stderr)


# ---- YAML for the fixed shapes we emit


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    return json.dumps(str(v), ensure_ascii=False)


def _block(s: str, indent: str) -> Optional[str]:
    """A literal block for a multi-line script, when every line can be kept as it is."""
    if "\n" not in s or any(c in s for c in "\r\t") or s != s.strip("\n") + "\n":
        return None
    lines = s.rstrip("\n").split("\n")
    if any(line != line.rstrip() or line.startswith(" ") for line in lines):
        return None
    return "|\n" + "".join(f"{indent}{line}\n" if line else "\n" for line in lines).rstrip("\n")


def to_yaml(value: Any, indent: str = "") -> str:
    """``value`` (dicts, lists, scalars) as block YAML."""
    out: List[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            key = _scalar(str(k)) if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-/]*", k) else k
            out.append(_item(f"{indent}{key}:", v, indent))
    elif isinstance(value, list):
        for v in value:
            out.append(_item(f"{indent}-", v, indent, in_list=True))
    else:
        return indent + _scalar(value)
    return "\n".join(out)


def _item(head: str, v: Any, indent: str, in_list: bool = False) -> str:
    inner = indent + "  "
    if isinstance(v, dict) and v:
        if in_list:  # "- key: value" with the rest aligned under the first key
            body = to_yaml(v, inner)
            return f"{head} {body[len(inner) :]}"
        return f"{head}\n{to_yaml(v, inner)}"
    if isinstance(v, list) and v:
        return f"{head}\n{to_yaml(v, inner if in_list else indent + '  ')}"
    if isinstance(v, (dict, list)):
        return f"{head} {'{}' if isinstance(v, dict) else '[]'}"
    if isinstance(v, str):
        block = _block(v, inner)
        if block is not None:
            return f"{head} {block}"
    return f"{head} {_scalar(v)}"


def comments(lines: List[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def write_out(text: str, out: Optional[str]) -> None:
    """``text`` to ``out`` ("-" or None: stdout), an existing file replaced atomically."""
    if out is None or out == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UsageError("--out", f"{parent} is not a directory", "create it first")
    if os.path.isdir(out):
        raise UsageError("--out", f"{out} is a directory", "give a file name")
    write_atomic(out, text.encode(), mode=0o644)


def relative_job_path(job_file: str) -> str:
    """The job file's path relative to the current directory (the project root), as it sits
    in the image or the synced workdir; its basename when it lies outside."""
    rel = os.path.relpath(os.path.abspath(job_file), os.getcwd())
    return os.path.basename(job_file) if rel.startswith("..") else rel
