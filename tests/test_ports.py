"""deepinfer/ports.py: the ports a server is given are distinct (separate one-port picks could return one port
twice, and tritonserver then exits: HTTP and metrics on one address), free to bind, and TritonServer refuses
a repeated port with a clear error before starting anything."""

import socket

import pytest

from deepinfer.ports import free_port, free_ports


def test_free_ports_are_distinct_and_bindable():
    for _ in range(50):
        ports = free_ports(8)
        assert len(set(ports)) == 8
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))          # nobody holds it after the pick


def test_triton_server_refuses_a_repeated_port(tmp_path):
    pytest.importorskip("tritonclient")
    from deepinfer.ensemble.serve import TritonServer
    with pytest.raises(ValueError, match="three distinct ports"):
        TritonServer(tmp_path, 8000, 8001, 8000)
