"""The first-contact note's head line (controller/contacts.py) reads right for every shipped
profile: it names the target met and the profile, and shows the profile's title as its title
(generic-ssh's read "first contact with Any box reachable over SSH (generic-ssh)", the title
taken for a platform's name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller import contacts
from onbox.profiles.load import load_all
from onbox.profiles.schema import Profile


@pytest.fixture(autouse=True)
def _own_laptop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)


@pytest.mark.parametrize("profile", load_all(), ids=lambda p: p.name)
def test_the_head_line_names_the_target_and_the_profile_with_its_title(profile: Profile) -> None:
    lines = contacts.first_contact("me@gpu.example.com", profile)
    if not lines:  # a profile with no danger clock and no convenience has no note
        return
    head = f"rgt: first contact with me@gpu.example.com under profile {profile.name}, "
    assert lines[0] == f'{head}"{profile.title}":', lines[0]
    assert contacts.first_contact("me@gpu.example.com", profile) == []  # once


def test_generic_ssh_reads_as_a_sentence() -> None:
    (generic,) = [p for p in load_all() if p.name == "generic-ssh"]
    head = contacts.first_contact("me@gpu.example.com", generic)[0]
    assert head == (
        "rgt: first contact with me@gpu.example.com under profile generic-ssh, "
        '"Any box reachable over SSH":'
    ), head
