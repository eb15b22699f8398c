"""The pure parts of `rgt smoke` (controller/smoke/checks.py, walk.check_request): the lines
it prints, the step rate, the state hashes a job prints, CRLF shell scripts, what a job leaves
outside its declared outputs, and the requests refused before anything starts."""

from __future__ import annotations

import os
from typing import Any, List

import pytest

from controller.smoke import checks
from controller.smoke.walk import SmokeRequest, check_request
from onbox.common.errors import SmokeFailed, UsageError
from onbox.common.sealtime import SealTime

A, B = "a" * 64, "b" * 64


def test_a_failure_prints_its_line_and_remedy_and_exits_19() -> None:
    lines: List[str] = []
    report = checks.Report(lines.append)
    report.ok(1, "started")
    err = report.fail(3, "no checkpoint", "write one")
    assert lines == [
        "ok   1 starts: started",
        "FAIL 3 checkpoint: no checkpoint",
        "       remedy: write one",
    ]
    assert isinstance(err, SmokeFailed) and err.exit_code == 19
    assert err.line() == "rgt: smoke check 3 (checkpoint) failed: no checkpoint (write one)"


def test_step_rate_from_first_and_last_sample() -> None:
    assert checks.step_rate([(10.0, 1), (12.0, 11)]) == 5.0
    assert checks.step_rate([(10.0, 1)]) is None
    assert checks.step_rate([(10.0, 5), (10.0, 5)]) is None
    assert checks.rate_text(5.0) == "5.0 steps/s"
    assert checks.rate_text(0.25) == "4.0 s/step"


def test_seal_time_is_printed_as_the_flag_to_pass() -> None:
    text = checks.seal_text(SealTime(2.3, 1, "measured"))
    assert "seal time 2.3 s" in text and "pass --seal-time 3" in text
    assert "upload only" in checks.seal_text(SealTime(0.01, 1, "m", upload_only=True))
    assert checks.seal_text(SealTime(None, 0, "none")) == "seal time not measured"


def test_state_hashes_one_per_line_or_on_one_line_last_wins() -> None:
    plain = f"step 3\nweights sha256 {A}\noptimizer sha256 {A}\nrng sha256 {A}\n"
    framework = f"weights sha256 {B} optimizer sha256 {B} rng sha256 {B}\n"
    assert checks.state_hashes(plain) == dict.fromkeys(checks.HASHES, A)
    assert checks.state_hashes(plain + framework) == dict.fromkeys(checks.HASHES, B)
    assert checks.state_hashes("weights sha256 short\n") == {}


def test_hash_mismatch_names_what_differs_or_is_missing() -> None:
    ref = {"weights": A, "optimizer": A}
    assert checks.hash_mismatch(ref, dict(ref)) == []
    assert checks.hash_mismatch(ref, {"weights": A, "optimizer": B}) == ["optimizer"]
    assert checks.hash_mismatch(ref, {}) == ["weights", "optimizer"]


def test_crlf_shell_scripts_by_suffix_or_shebang(tmp_path: Any) -> None:
    files = {
        "run.sh": b"echo hi\r\n",
        "tool": b"#!/usr/bin/env bash\r\necho hi\r\n",
        "ok.sh": b"echo hi\n",
        "notes.txt": b"a\r\nb\r\n",
        "train.py": b"#!/usr/bin/env python\r\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    os.symlink("run.sh", tmp_path / "link.sh")
    assert checks.crlf_scripts(str(tmp_path), sorted(files) + ["link.sh", "gone.sh"]) == [
        "run.sh",
        "tool",
    ]


def test_left_behind_is_what_no_declared_output_covers(tmp_path: Any) -> None:
    for rel in ("train.py", "out/model.pt", "outputs.json", "logs/a.txt", "__pycache__/x.pyc"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    after = checks.tree(str(tmp_path))
    assert "__pycache__/x.pyc" not in after
    left = checks.left_behind({"train.py"}, after, ["out/", "outputs.json"])
    assert left == ["logs/a.txt"]


@pytest.mark.parametrize(
    "req,field",
    [
        (SmokeRequest(), "CMD"),
        (SmokeRequest(command=["x"], steps=5, seconds=3.0), "--steps"),
        (SmokeRequest(command=["x"], steps=1), "--steps"),
    ],
)
def test_requests_that_cannot_be_walked_are_refused(req: SmokeRequest, field: str) -> None:
    with pytest.raises(UsageError) as e:
        check_request(req)
    assert e.value.field == field and e.value.exit_code == 2


def test_keep_must_name_a_new_or_empty_directory(tmp_path: Any) -> None:
    (tmp_path / "x").write_text("x")
    with pytest.raises(UsageError):
        check_request(SmokeRequest(command=["x"], keep=str(tmp_path)))
    check_request(SmokeRequest(command=["x"], keep=str(tmp_path / "new")))
