"""The MANIFEST and LATEST a restore reads from the store: untrusted input, so anything
malformed is an IntegrityError (the restore quarantines that checkpoint and falls back),
never another exception that ends the restore, and no key names a step rgt did not write."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List

import pytest

from onbox.common.errors import IntegrityError
from onbox.sealing import manifest as mf

RUN = "r"


def _doc(paths: List[str]) -> Dict[str, Any]:
    files = [
        {
            "path": p,
            "size": 1,
            "sha256": hashlib.sha256(b"x").hexdigest(),
            "key": mf.new_object_key(RUN, 10, 1, p),
        }
        for p in paths
    ]
    return mf.new_manifest(RUN, 10, 1, "ck", "dir", files)


def test_a_manifest_of_plain_files_parses() -> None:
    doc = mf.parse_manifest(mf.dump(_doc(["ck/a", "ck/b/c"])))
    assert [f["path"] for f in doc["files"]] == ["ck/a", "ck/b/c"]


@pytest.mark.parametrize("paths", [["ck/a", "ck/a/b"], ["ck/a/b/c", "ck/z", "ck/a"]])
def test_a_path_that_is_also_another_paths_directory_is_refused(paths: List[str]) -> None:
    # Restored, the second rename would land on (or under) the first file: refused here, the
    # checkpoint is quarantined; before, the restore failed midway with files renamed into
    # place and no fallback.
    with pytest.raises(IntegrityError, match="is listed, and so is"):
        mf.parse_manifest(mf.dump(_doc(paths)))


@pytest.mark.parametrize("parse", [mf.parse_manifest, mf.parse_latest])
def test_json_nested_past_the_parsers_depth_is_an_integrity_error(parse: Any) -> None:
    # json.loads raises RecursionError on such input, which ended the restore uncaught.
    with pytest.raises(IntegrityError, match="not valid JSON"):
        parse(b"[" * 200_000)


@pytest.mark.parametrize(
    "key, step",
    [
        ("r/checkpoints/10/MANIFEST.json", 10),
        ("r/checkpoints/0/MANIFEST.json", 0),
        ("r/checkpoints/10/e1/ck/15/MANIFEST.json", None),  # a checkpoint's own file
        ("r/checkpoints/007/MANIFEST.json", None),  # not how rgt writes step 7
        ("r/checkpoints/\u00b2/MANIFEST.json", None),  # a digit to str.isdigit, not to int()
        ("r/checkpoints/1_0/MANIFEST.json", None),
        ("other/checkpoints/10/MANIFEST.json", None),
    ],
)
def test_only_a_key_rgt_writes_for_a_manifest_names_a_step(key: str, step: Any) -> None:
    assert mf.manifest_step(RUN, key) == step


def test_a_manifest_from_before_links_parses_and_one_with_a_link_in_it_too() -> None:
    old = _doc(["ck/a"])
    assert "links" not in old  # none recorded: the document is as before
    assert "links" not in mf.parse_manifest(mf.dump(old))
    doc = dict(old, links=[{"name": "latest", "target": "ck"}, {"name": "w", "target": "ck/a"}])
    assert mf.parse_manifest(mf.dump(doc))["links"] == doc["links"]


@pytest.mark.parametrize(
    "links",
    [
        {"name": "latest", "target": "ck"},
        [{"name": "latest", "target": "/etc"}],
        [{"name": "latest", "target": "ck/../.."}],
        [{"name": "latest", "target": "other"}],
        [{"name": "latest", "target": "ckx"}],
        [{"name": "a/b", "target": "ck"}],
        [{"name": "..", "target": "ck"}],
        [{"name": "ck", "target": "ck"}],
        [{"name": ".rgt-restore-1", "target": "ck"}],
        [{"name": "latest"}],
        ["latest"],
    ],
)
def test_a_link_that_would_lead_out_of_the_dir_or_over_a_file_is_refused(links: Any) -> None:
    with pytest.raises(IntegrityError):
        mf.parse_manifest(mf.dump(dict(_doc(["ck/a"]), links=links)))
