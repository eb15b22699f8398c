"""The redactor masks a secret in every common encoding and known token shapes, and leaves
everything else exactly as it was."""

from __future__ import annotations

import base64
import json
import os
import urllib.parse
from typing import Any

import pytest

from onbox.common import redact
from onbox.common.redact import MARK, MIN_SECRET_LEN, Redactor

SECRET = "s3cr3t-" + os.urandom(8).hex()
# A value with characters that URL and JSON encodings change.
ODD = "p@ss w/rd+&=?" + os.urandom(4).hex() + '"\\é'


def red(*values: str) -> Redactor:
    return Redactor([(f"V{i}", v) for i, v in enumerate(values)])


def test_the_value_itself_is_masked_everywhere_it_occurs() -> None:
    r = red(SECRET)
    text = f"auth failed with token {SECRET}; again {SECRET}!"
    assert r.redact(text) == f"auth failed with token {MARK}; again {MARK}!"
    assert r.found(text) == ["V0"]


@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
@pytest.mark.parametrize("before", [b"", b"a", b"ab", b"abc", b"Bearer: "])
@pytest.mark.parametrize("after", [b"", b"x", b"xy", b"xyz"])
def test_base64_at_every_alignment_inside_a_longer_string(
    encode: Any, before: bytes, after: bytes
) -> None:
    for value in (SECRET, ODD):
        blob = encode(before + value.encode() + after).decode()
        for text in (blob, blob.rstrip("="), f"header {blob} trailer"):
            out = red(value).redact(text)
            assert out.count(MARK) == 1, (value, text)
            # All of the value's characters but the edges (which mix in the neighbours' bits)
            # are gone: the value is 4/3 as long in base64.
            masked = len(text) - (len(out) - len(MARK))
            assert masked >= 4 * len(value.encode()) // 3 - 2
            assert base64.b64encode(value.encode()).decode().rstrip("=") not in out


def test_a_standalone_base64_value_leaves_nothing_of_it() -> None:
    for value in (SECRET, ODD):
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            full = enc(value.encode()).decode()
            assert red(value).redact(f"k={full};") == f"k={MARK};"
            assert red(value).redact(f"k={full.rstrip('=')};") == f"k={MARK};"


@pytest.mark.parametrize(
    "form",
    [
        urllib.parse.quote(ODD, safe=""),
        urllib.parse.quote(ODD),
        urllib.parse.quote_plus(ODD),
        urllib.parse.quote(ODD, safe="").lower(),  # some encoders write %2f
        json.dumps(ODD)[1:-1],
        json.dumps(ODD, ensure_ascii=False)[1:-1],
    ],
    # Named, not shown: the value is random, and parallel workers must collect the same ids.
    ids=["quote", "quote-slash", "quote-plus", "quote-lower", "json", "json-utf8"],
)
def test_url_and_json_encoded(form: str) -> None:
    out = red(ODD).redact(f"GET /login?pw={form}&next=1")
    assert out == f"GET /login?pw={MARK}&next=1"


def test_a_redacted_json_document_stays_json() -> None:
    doc = {"reason": f"RuntimeError: token {ODD}", "n": 3, "list": [ODD, None], ODD: True}
    out = red(ODD).redact_obj(doc)
    assert out == {
        "reason": f"RuntimeError: token {MARK}",
        "n": 3,
        "list": [MARK, None],
        MARK: True,
    }
    dumped = json.dumps(doc)
    assert ODD not in json.loads(red(ODD).redact(dumped)).get("reason", MARK)
    assert json.dumps(ODD)[1:-1] not in red(ODD).redact(dumped)


@pytest.mark.parametrize(
    "text,masked,label",
    [
        ("token hf_" + "aB3" * 12 + " ok", "token " + MARK + " ok", "an hf_ token"),
        ("id AKIAIOSFODNN7EXAMPLE, key", "id " + MARK + ", key", "an AWS key id"),
        ("ASIAY34FZKBOKMUTVV7A", MARK, "an AWS key id"),
        (
            "GET https://b.s3.amazonaws.com/k?X-Amz-Signature=ab12cd34ef&X-Amz-Date=1",
            "GET https://b.s3.amazonaws.com/k?X-Amz-Signature=" + MARK + "&X-Amz-Date=1",
            "an X-Amz-Signature",
        ),
        (
            "?X-Amz-Security-Token=IQoJb3JpZ2luX2VjE%2F&a=b",
            "?X-Amz-Security-Token=" + MARK + "&a=b",
            "an X-Amz-Security-Token",
        ),
        (
            "clone https://alice:pa55word@git.example.com/r.git",
            "clone https://alice:" + MARK + "@git.example.com/r.git",
            "a password in a URL",
        ),
        ("postgres://u:p@db/x", "postgres://u:" + MARK + "@db/x", "a password in a URL"),
        ("ghp_" + "x" * 36, MARK, "a GitHub token"),
        ("Authorization: Bearer eyJhbGc.x.y", "Authorization: Bearer " + MARK, None),
    ],
)
def test_token_shapes_are_masked_whatever_their_value(
    text: str, masked: str, label: str | None
) -> None:
    r = Redactor()
    assert r.redact(text) == masked
    if label:
        assert label in r.found(text)


def test_short_values_are_not_matched_by_value() -> None:
    short = "x" * (MIN_SECRET_LEN - 1)
    r = red(short, "abc")
    text = f"exited with code 1 after {short} steps, abc"
    assert r.redact(text) == text
    assert redact.encodings(short) == []


def test_overlapping_secrets_leave_nothing_between_them() -> None:
    a, b = "alpha-beta-gamma", "gamma-delta-eps"
    r = red(a, b)
    assert r.redact("x alpha-beta-gamma-delta-eps y") == f"x {MARK} y"
    assert r.redact("x alpha-beta-gamma-delta-eps y".replace(" y", "")) == f"x {MARK}"
    # One secret inside another.
    r = red("inner-part", "outer-inner-part-end")
    assert r.redact("[outer-inner-part-end] inner-part") == f"[{MARK}] {MARK}"
    assert r.found("outer-inner-part-end") == ["V0", "V1"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "attempt 3: exited with code 1",
        "RuntimeError: CUDA out of memory at step 120 | last output: step 120 loss 2.3",
        "epoch 4 in file:///mnt/durable/rgt; LATEST is 120",
        "sealed step 8: 3 files, sha256 " + "ab" * 32,
        "https://huggingface.co/user/repo; ssh://git@github.com/x; http://host:8080/a@b",
        "unicode ünïcödé \u2603 and bytes \udcff",
    ],
)
def test_text_without_secrets_is_unchanged(text: str) -> None:
    r = red(SECRET, ODD)
    assert r.redact(text) == text
    assert r.found(text) == []
    assert r.redact_bytes(text.encode("utf-8", "surrogateescape")) == text.encode(
        "utf-8", "surrogateescape"
    )


def test_bytes_that_are_not_utf8_pass_through() -> None:
    data = b"\xff\xfe bin " + SECRET.encode() + b" \x80\x00"
    assert red(SECRET).redact_bytes(data) == b"\xff\xfe bin " + MARK.encode() + b" \x80\x00"


def test_a_file_is_redacted_in_chunks_without_missing_a_value_across_a_boundary(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redact, "_CHUNK", 7)  # every value spans several reads
    monkeypatch.setattr(redact, "_KEEP", 1)
    src, dst = str(tmp_path / "in.log"), str(tmp_path / "out.log")
    b64 = base64.b64encode(b"x" + SECRET.encode()).decode()
    body = f"step 1\nhello {SECRET}\nb64 {b64}\né{SECRET}é\n" * 3 + "plain\n"
    with open(src, "w") as f:
        f.write(body)
    r = red(SECRET)
    assert r.scan_file(src) == ["V0"]
    assert r.redact_file(src, dst) == ["V0"]
    with open(dst) as f:
        out = f.read()
    assert out == r.redact(body)
    assert SECRET not in out and out.count(MARK) == 9
    with open(src) as f:
        assert f.read() == body  # the source is not touched
    assert os.stat(dst).st_mode & 0o077 == 0


def test_the_box_redactor_knows_every_run_and_credential_variables(tmp_path: Any) -> None:
    home = str(tmp_path)
    os.makedirs(os.path.join(home, "secrets"))
    with open(os.path.join(home, "secrets", "a"), "w") as f:
        json.dump({"WANDB_API_KEY": "wandb-" + SECRET}, f)
    env = {"AWS_SECRET_ACCESS_KEY": "aws-" + SECRET, "HF_TOKEN_PATH": "/root/.hf/token"}
    pairs = redact.box_secrets(home, env)
    assert ("WANDB_API_KEY", "wandb-" + SECRET) in pairs
    assert ("AWS_SECRET_ACCESS_KEY", "aws-" + SECRET) in pairs
    assert all(k != "HF_TOKEN_PATH" for k, _ in pairs)  # a path, not a secret

    # Cached, and built again when `rgt-agent secrets` rewrites a file.
    first = redact.for_home(home)
    assert redact.for_home(home) is first
    assert first.redact("wandb-" + SECRET) == MARK
    with open(os.path.join(home, "secrets", "b"), "w") as f:
        json.dump({"NEW_TOKEN": "new-" + SECRET}, f)
    assert redact.for_home(home).redact("x new-" + SECRET) == "x " + MARK
    run_file = os.path.join(home, "runs", "r", "state.json")
    assert redact.for_run_file(run_file) is redact.for_home(home)


def test_the_redacting_stream_redacts_whole_lines(tmp_path: Any) -> None:
    import io

    inner = io.StringIO()
    s = redact.RedactingStream(inner, lambda: red(SECRET))
    s.write("Traceback: RuntimeError: ")
    s.write(SECRET[:5])  # written in pieces, as the interpreter prints an exception
    s.write(SECRET[5:] + "\nnext ")
    assert inner.getvalue() == f"Traceback: RuntimeError: {MARK}\n"
    s.write(SECRET)
    s.flush()
    assert inner.getvalue() == f"Traceback: RuntimeError: {MARK}\nnext {MARK}"
