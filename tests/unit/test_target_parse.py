"""TARGET as users paste it: ssh's URI form (``ssh://user@host:port``, which OpenSSH takes and
dashboards print) means what the same user@host:port means; anything more in it is refused
before anything is done. A pasted line's port forwards (vast.ai's carries one for Jupyter) are
left out; other options are still refused by name."""

from __future__ import annotations

import pytest

from controller.target import Target, parse_target
from onbox.common.errors import UsageError


@pytest.mark.parametrize(
    ("given", "means"),
    [
        ("ssh://root@127.0.0.1:2222", "root@127.0.0.1:2222"),
        ("SSH://root@box.example.com/", "root@box.example.com"),
        ("ssh://gpu1", "gpu1"),
        ("ssh://root@[fe80::1%eth0]:22", "root@[fe80::1%eth0]:22"),
        ("ssh -i /k/id ssh://me@host:40123", "ssh -i /k/id me@host:40123"),
    ],
)
def test_an_ssh_uri_means_the_same_as_its_destination(given: str, means: str) -> None:
    assert parse_target(given) == parse_target(means)
    assert parse_target(given).kind == "ssh"


def test_the_uri_fields_land_where_ssh_puts_them() -> None:
    assert parse_target("ssh://root@connect.example.com:40123") == Target(
        "ssh", host="connect.example.com", user="root", port=40123
    )


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("ssh://root@host:22/home/x", "path or parameters"),
        ("ssh://root;fingerprint=SHA256-x@host", "path or parameters"),
        ("ssh://root@fe80::1:22", "in brackets"),
        ("ssh://root@host:99999", "not a number from 1 to 65535"),
        ("ssh://-oProxyCommand=x", "starts with '-'"),
        ("ssh://", "no host given"),
    ],
)
def test_an_ssh_uri_with_more_or_less_is_refused_saying_what(given: str, said: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_target(given)
    assert said in str(e.value), str(e.value)


def test_a_pasted_line_with_port_forwards_is_taken_without_them() -> None:
    vast = "ssh -p 31234 root@ssh4.vast.ai -L 8080:localhost:8080"
    assert parse_target(vast) == Target("ssh", host="ssh4.vast.ai", user="root", port=31234)
    both = "ssh -L8888:localhost:8888 -D 1080 -p 22 me@box"
    assert parse_target(both) == Target("ssh", host="box", user="me", port=22)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("ssh root@box -L", "the ssh option -L needs a value"),
        ("ssh root@box -o ProxyCommand=x", "the ssh option '-o' is not one rgt passes on"),
        ("ssh root@box -R 9000:localhost:9000", "the ssh option '-R' is not one rgt passes on"),
    ],
)
def test_other_options_of_a_pasted_line_are_still_refused(given: str, said: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_target(given)
    assert said in str(e.value), str(e.value)
