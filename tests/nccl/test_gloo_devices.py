"""Which address a rank's gloo device advertises: loopback, ``GLOO_SOCKET_IFNAME``, or the route.

The namespaced version (a node whose host name resolves to loopback) is in
``tests/multinode/test_nccl_http.py``.
"""

from __future__ import annotations

import pytest

from wtcore import TransferError
from wtcore_nccl.group import GlooDevice, gloo_devices, route_source


def test_loopback_master_binds_loopback_whatever_the_interface_variable() -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth7"}
    for address in ("127.0.0.1", "localhost", "::1"):
        assert gloo_devices(address, 29500, env) == [GlooDevice(hostname="127.0.0.1")]


def test_interface_variable_is_honoured_one_device_per_name() -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth0, ib0,"}
    assert gloo_devices("10.1.2.3", 29500, env) == [
        GlooDevice(interface="eth0"),
        GlooDevice(interface="ib0"),
    ]


def test_without_the_variable_the_routed_source_address_is_used() -> None:
    # 127.0.0.2 is not in the loopback shortcut list, but the kernel routes it over lo.
    assert gloo_devices("127.0.0.2", 29500, {"GLOO_SOCKET_IFNAME": ""}) == [
        GlooDevice(hostname="127.0.0.1")
    ]
    assert route_source("127.0.0.5", 1) == "127.0.0.1"


def test_an_unresolvable_master_address_is_a_clear_error() -> None:
    with pytest.raises(
        TransferError, match=r"master_address 'no-such-host\.invalid' does not resolve"
    ):
        route_source("no-such-host.invalid", 29500)
