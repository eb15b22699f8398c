"""How a target is shown (controller/target.py ``Target.label``): an IPv6 host in brackets,
``user@[fe80::2%vh-x]:2222`` (the form rgt takes as TARGET), not ``user@fe80::2%vh-x:2222``,
where the port cannot be told from the address; and first contact (controller/contacts.py),
which remembers targets by that label, still knows one it met under the old form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller import contacts
from controller.target import parse_target
from onbox.profiles.load import load_all


@pytest.mark.parametrize(
    "given, shown",
    [
        ("root@[fe80::2%vh-x]:2222", "root@[fe80::2%vh-x]:2222"),
        ("ssh -p 2222 root@fe80::2%vh-x", "root@[fe80::2%vh-x]:2222"),
        ("[::1]", "[::1]"),
        ("me@gpu.example.com:2200", "me@gpu.example.com:2200"),
        ("me@10.0.0.2", "me@10.0.0.2"),
    ],
)
def test_an_ipv6_host_is_shown_in_brackets_and_the_label_reads_back(given: str, shown: str) -> None:
    t = parse_target(given)
    assert t.label == shown
    back = parse_target(t.label)  # the label is a TARGET rgt takes, naming the same box
    assert (back.user, back.host, back.port) == (t.user, t.host, t.port)


def test_first_contact_knows_an_ipv6_target_met_under_the_old_label(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """contacts.json written before the brackets holds ``root@fe80::2%vh-x:2222 PROFILE``:
    that meeting still counts (its notes are not shown as a first contact again)."""
    home = tmp_path / "ctl"
    home.mkdir()
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(home))
    (generic,) = [p for p in load_all() if p.name == "generic-ssh"]
    old = f"root@fe80::2%vh-x:2222 {generic.name}"
    (home / contacts.FILE).write_text(json.dumps({"seen": {old: 1.0}}))
    t = parse_target("root@[fe80::2%vh-x]:2222")
    assert contacts.first_contact(t.label, generic) == []
    # A target not met under either form is still a first contact.
    assert contacts.first_contact(parse_target("root@[fe80::3]:22").label, generic)
