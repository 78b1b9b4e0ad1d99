"""The port helpers both packages use: a port handed out can be bound, and a range skips what is
taken and says so when nothing is left."""

import socket

import pytest

from nemo_gym_ext.ports import NoFreePortError, free_port, free_port_in_range


def _bound(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, port))
    return listener


def test_a_free_port_can_be_bound():
    with _bound("", free_port()):
        pass


def test_a_range_skips_a_taken_port_and_refuses_when_none_is_left():
    with _bound("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        assert port < free_port_in_range("127.0.0.1", port, port + 50) < port + 50
        with pytest.raises(NoFreePortError, match=rf"no free port in \[{port}, {port + 1}\)"):
            free_port_in_range("127.0.0.1", port, port + 1)
