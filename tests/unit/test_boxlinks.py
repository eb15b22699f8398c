"""The links a box without a store lists, as ``rgt pull`` judges them (controller/results/
boxlinks.py): what a hostile box's listing could say that no real ``find`` prints (a name with
'/' or '..', a target with a control character, a prefix of the checkpoint dir's name) is left
out with its reason, never made; a link to a pulled checkpoint is made relative."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import controller
from controller.results.boxlinks import MAX_NAMED, judged

CKPT = "/box/runs/r1/ckpt"
PULLED = {"checkpoints/step_4.ckpt", "checkpoints/step_2/model.pt", "outputs/out/a.txt"}


def _one(kind: str, rel: str, target: str) -> str:
    prefix = "checkpoints/" if kind == "checkpoint" else "outputs/"
    made, left = judged([(kind, prefix + rel, rel, target)], CKPT, PULLED)
    assert not made, made
    (line,) = left
    return line


def test_links_to_a_pulled_checkpoint_are_made_relative_and_normalised() -> None:
    listed = [
        ("checkpoint", "checkpoints/last.ckpt", "last.ckpt", "step_4.ckpt"),
        ("checkpoint", "checkpoints/latest", "latest", "./step_2/"),
        ("checkpoint", "checkpoints/abs", "abs", CKPT + "/step_2/model.pt"),
        ("checkpoint", "checkpoints/back", "back", "../ckpt/step_4.ckpt"),
    ]
    made, left = judged(listed, CKPT, PULLED)
    assert left == []
    assert made == [
        ("abs", "step_2/model.pt"),
        ("back", "step_4.ckpt"),
        ("last.ckpt", "step_4.ckpt"),
        ("latest", "step_2"),
    ]


def test_what_a_hostile_listing_says_is_left_out_with_why() -> None:
    assert "out of the checkpoint dir" in _one("checkpoint", "x", "/etc/passwd")
    assert "out of the checkpoint dir" in _one("checkpoint", "x", "../../x")
    assert "out of the checkpoint dir" in _one("checkpoint", "x", "/box/runs/r1/ckptX/step_4.ckpt")
    assert "could not be read on the box" in _one("checkpoint", "x", "")
    assert "out of the checkpoint dir" in _one("checkpoint", "x", ".")
    assert "'..'" in _one("checkpoint", "../x", "step_4.ckpt")
    assert "'..'" in _one("checkpoint", "..", "step_4.ckpt")
    assert "control character" in _one("checkpoint", "a\x1bb", "step_4.ckpt")
    assert "control character" in _one("checkpoint", "x", "step_4\x1b.ckpt")
    assert "hidden or temporary" in _one("checkpoint", ".rgt-link.tmp", "step_4.ckpt")
    assert "take the place of a pulled file" in _one("checkpoint", "step_2", "step_4.ckpt")
    assert "nothing pulled" in _one("checkpoint", "x", "step_9.ckpt")
    assert "nothing pulled" in _one("checkpoint", "x", "x/y")  # a link into itself
    assert "in the outputs" in _one("output", "out/evil", "a.txt")
    assert "logs" in _one("log", "0001/x", "output.log")
    # The box's names are shown as repr where they are not printable (a receipt line).
    assert _one("checkpoint", "a\x01", "/etc/passwd").startswith("'checkpoints/a\\x01' -> ")


def test_a_box_of_many_bad_links_is_counted_past_the_first_named() -> None:
    listed = [("output", f"outputs/out/l{i}", f"out/l{i}", "/etc/passwd") for i in range(500)]
    made, left = judged(listed, CKPT, PULLED)
    assert made == [] and len(left) == MAX_NAMED + 1
    assert left[-1] == f"and {500 - MAX_NAMED} more links, left out"


def test_an_absolute_link_to_where_a_linked_checkpoint_dir_leads_is_made_relative() -> None:
    """The checkpoint dir is a link to a data disk (the box's lister says where it leads): a
    link in it naming a checkpoint by that real path leads into the dir, as the seal resolves
    it; one to a sibling of the real dir still leads out."""
    real = "/data/ckpt"
    listed = [
        ("checkpoint", "checkpoints/resolved", "resolved", real + "/step_4.ckpt"),
        ("checkpoint", "checkpoints/beside", "beside", real + "X/step_4.ckpt"),
    ]
    made, left = judged(listed, CKPT, PULLED, real)
    assert made == [("resolved", "step_4.ckpt")]
    assert left == [
        "checkpoints/beside -> '/data/ckptX/step_4.ckpt': it leads out of the checkpoint dir"
    ]


def test_links_below_the_top_are_judged_from_their_own_directory() -> None:
    """A link in a checkpoint's directory names its target from there: made, relative to it,
    when that is a pulled file or directory in the checkpoint dir; left out otherwise."""
    pulled = PULLED | {"checkpoints/step_2/sub/cfg.json", "checkpoints/step_6/model.pt"}
    listed = [
        ("checkpoint", "checkpoints/step_6/prev.pt", "step_6/prev.pt", "../step_2/model.pt"),
        ("checkpoint", "checkpoints/step_6/abs.pt", "step_6/abs.pt", CKPT + "/step_4.ckpt"),
        ("checkpoint", "checkpoints/step_6/two", "step_6/two", "../step_2"),
        ("checkpoint", "checkpoints/step_2/sub/m", "step_2/sub/m", "../model.pt"),
        ("checkpoint", "checkpoints/step_2/sub/up", "step_2/sub/up", "../../step_4.ckpt"),
    ]
    made, left = judged(listed, CKPT, pulled)
    assert left == []
    assert made == [
        ("step_2/sub/m", "../model.pt"),
        ("step_2/sub/up", "../../step_4.ckpt"),
        ("step_6/abs.pt", "../step_4.ckpt"),
        ("step_6/prev.pt", "../step_2/model.pt"),
        ("step_6/two", "../step_2"),
    ]


def test_hostile_links_below_the_top_are_left_out_with_why() -> None:
    def one(rel: str, target: str) -> str:
        made, left = judged([("checkpoint", "checkpoints/" + rel, rel, target)], CKPT, PULLED)
        assert not made, made
        (line,) = left
        return line

    assert "out of the checkpoint dir" in one("step_2/x", "../../x")
    assert "out of the checkpoint dir" in one("step_2/x", "..")
    assert "out of the checkpoint dir" in one("step_2/x", "/etc/passwd")
    assert "a directory that holds it" in one("step_2/x", ".")
    assert "a directory that holds it" in one("step_2/x", "../step_2")
    assert "nothing pulled" in one("step_2/x", "model.pt/x")
    assert "nothing pulled" in one("step_2/x", "../step_9.ckpt")
    assert "take the place of a pulled file" in one("step_2/model.pt", "../step_4.ckpt")
    assert "take the place of a pulled file" in one("step_2", "step_4.ckpt")
    assert "its directory is a pulled file" in one("step_4.ckpt/x", "../step_4.ckpt")
    assert "its directory is a pulled file" in one("step_4.ckpt/y/x", "../../step_2")
    assert "hidden or temporary" in one("step_2/.git/x", "../../step_4.ckpt")
    assert "'..'" in one("step_2/../../x", "step_4.ckpt")
    assert "empty component" in one("step_2//x", "../step_4.ckpt")


def test_a_link_whose_target_the_box_could_not_read_is_left_out_saying_so() -> None:
    """The box's lister prints an empty target for a link ``readlink`` could not read (no
    link has an empty target): it was left out as one that "leads out of the checkpoint dir",
    which it may not."""
    line = _one("checkpoint", "step_2/last.pt", "")
    assert "could not be read on the box" in line, line
    assert "out of the checkpoint dir" not in line, line


def test_a_link_in_a_directory_no_file_pulled_is_in_is_made_there() -> None:
    """``only/x -> ../step_4.ckpt`` (a checkpoint of links only) was left out, "no file pulled is
    in its directory": made now (its directory is made for it). A listing that also names
    ``only`` as a link (no real find prints both) leaves ``only/x`` out, never made through it."""
    made, left = judged(
        [("checkpoint", "checkpoints/only/x", "only/x", "../step_4.ckpt")], CKPT, PULLED
    )
    assert (made, left) == ([("only/x", "../step_4.ckpt")], [])
    listed = [
        ("checkpoint", "checkpoints/only", "only", "step_2"),
        ("checkpoint", "checkpoints/only/x", "only/x", "../step_4.ckpt"),
    ]
    made, left = judged(listed, CKPT, PULLED)
    assert made == [("only", "step_2")]
    (line,) = left
    assert line.startswith("checkpoints/only/x -> ") and "its directory is a link" in line, line


def test_a_relative_link_in_a_linked_checkpoint_dir_is_judged_from_where_it_really_is() -> None:
    """The checkpoint dir (…/ckpt) is a link to /data/disk: the box resolves a link's '..' from
    /data/disk, so ``../disk/step_4.ckpt`` leads into the dir and ``../ckpt/step_4.ckpt`` does
    not; judged by the dir's name, it was the other way round."""
    listed = [
        ("checkpoint", "checkpoints/real", "real", "../disk/step_4.ckpt"),
        ("checkpoint", "checkpoints/named", "named", "../ckpt/step_4.ckpt"),
        ("checkpoint", "checkpoints/step_2/up", "step_2/up", "../step_4.ckpt"),
    ]
    made, left = judged(listed, CKPT, PULLED, "/data/disk")
    assert made == [("real", "step_4.ckpt"), ("step_2/up", "../step_4.ckpt")]
    assert left == [
        "checkpoints/named -> '../ckpt/step_4.ckpt': it leads out of the checkpoint dir"
    ]


def test_the_box_lister_gives_a_link_readlink_fails_on_an_empty_target_and_goes_on_fake_readlink(
    tmp_path: Any,
) -> None:
    """controller/shell/boxfiles.sh run here under sh, with a fake readlink that fails (as one
    does on a link removed since find saw it): the link comes out with an empty target (what
    judged says "could not be read on the box" of), the files still listed, exit 0."""
    ck, bin_dir = tmp_path / "ck", tmp_path / "bin"
    ck.mkdir()
    bin_dir.mkdir()
    (ck / "a").write_bytes(b"hi\n")
    os.symlink("a", ck / "l")
    (bin_dir / "readlink").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "readlink").chmod(0o755)
    script = os.path.join(os.path.dirname(controller.__file__), "shell", "boxfiles.sh")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    got = subprocess.run(
        ["sh", script, "checkpoint", str(ck)], env=env, capture_output=True, timeout=60
    )
    assert got.returncode == 0, got
    fields = got.stdout.decode().split("\0")
    records = [fields[i : i + 4] for i in range(0, len(fields) - 1, 4)]  # in find's order
    assert ["link", "checkpoint", "", str(ck / "l")] in records, records
    assert [(r[0], r[2], r[3]) for r in records if r[0] != "link"] == [
        ("checkpoint", "3", str(ck / "a"))
    ], records
