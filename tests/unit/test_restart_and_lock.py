"""Restarting on the same port right after a stop, and one appliance per data dir."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from appliance.config.datadir import lock_data_dir
from appliance.domain.errors import DataDirError
from appliance.engines.supervision.preflight import bind_error


def test_a_port_whose_last_connection_is_in_time_wait_is_free_for_a_server() -> None:
    """A stopped server closed its connections first, so they wait in TIME_WAIT on its port
    for up to a minute; a server (SO_REUSEADDR) can bind it at once, and the check agrees."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the API server
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server side closes first: its end goes to TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the condition is real: a plain bind is refused
    assert bind_error("127.0.0.1", port) is None


def test_a_port_something_listens_on_is_not_free() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert bind_error("127.0.0.1", listener.getsockname()[1]) is not None


def test_a_second_appliance_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    refused = pytest.raises(DataDirError, match=r"in use by another appliance \(pid \d+\)")
    with lock_data_dir(tmp_path), refused, lock_data_dir(tmp_path):
        pass
    with lock_data_dir(tmp_path):  # released when the first one stopped
        pass
