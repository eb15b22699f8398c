"""The timeout an ``hf://`` store gives huggingface_hub's HTTP client, tied to its stall bound
(onbox/sealing/stores/hfmoved.py ``bound_idle_requests``), so that an upload's thread left
after a cut ends: twice the largest bound given in the process, on connect, read and write,
none on the wait for a pooled connection; left as it was where huggingface_hub has no client
factory. The client's timeout is read, no request is made."""

from __future__ import annotations

import sys
from typing import Iterator, Optional, Tuple

import pytest

# The Hub's client is an optional extra (the Python 3.9 stage of the test command has none).
pytest.importorskip("huggingface_hub")
from huggingface_hub import close_session, get_session, set_client_factory  # noqa: E402
from huggingface_hub.utils._http import default_client_factory  # noqa: E402

from onbox.sealing.stores import hfmoved


@pytest.fixture(autouse=True)
def fresh_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No timeout given yet in this process; huggingface_hub's own factory again afterwards."""
    monkeypatch.setattr(hfmoved, "_idle", None)
    set_client_factory(default_client_factory)
    try:
        yield
    finally:
        set_client_factory(default_client_factory)
        close_session()


def _timeouts() -> Tuple[Optional[float], ...]:
    t = get_session().timeout
    return t.connect, t.read, t.write, t.pool


def test_the_client_gets_twice_the_largest_bound_given() -> None:
    assert _timeouts() == (None, None, None, None)  # huggingface_hub's own: none at all
    hfmoved.bound_idle_requests(3.0)
    assert _timeouts() == (6.0, 6.0, 6.0, None)
    hfmoved.bound_idle_requests(1.0)  # a shorter bound (a preemption's rest of the grace)
    assert _timeouts() == (6.0, 6.0, 6.0, None)
    hfmoved.bound_idle_requests(300.0)
    assert _timeouts() == (600.0, 600.0, 600.0, None)


def test_a_huggingface_hub_without_a_client_factory_is_left_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before 1.0 (requests) huggingface_hub has no ``utils._http.default_client_factory``."""
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "huggingface_hub.utils._http", None)
        hfmoved.bound_idle_requests(3.0)
    assert _timeouts() == (None, None, None, None)
