"""A store given as a bare path (the commonest slip) is refused with the URL that means it; other
non-URLs get the accepted forms. Nothing is guessed: the store must be the durable place the
user meant, on the box."""

from __future__ import annotations

import pytest

from onbox.common.errors import UsageError
from onbox.common.storeurl import parse_store_url


def test_a_bare_absolute_path_is_refused_naming_its_file_url() -> None:
    with pytest.raises(UsageError) as e:
        parse_store_url("/mnt/durable/rgt", "--store")
    assert "is not a store URL" in e.value.line()
    assert "write file:///mnt/durable/rgt for that path" in e.value.line()
    assert parse_store_url("file:///mnt/durable/rgt").scheme == "file"


@pytest.mark.parametrize("given", ["bucket", "s3:/bucket", ""])
def test_other_non_urls_are_shown_the_accepted_forms(given: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_store_url(given, "--store")
    assert "s3://bucket/prefix" in e.value.line() and "for that path" not in e.value.line()
