"""Ports handed to the processes a test or benchmark starts (a Mooncake master takes three)."""

from __future__ import annotations

import socket

from mmferry.testing.ports import free_port


def test_no_port_is_handed_out_twice():
    """Five hundred asks in a row: the kernel's probe alone repeats a port in nearly every run of
    this many (two of a master's servers then share one and it exits), so each must differ."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_a_port_handed_out_can_be_listened_on():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen(1)
