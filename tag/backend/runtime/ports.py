"""TCP ports and addresses for local TF servers: free ports, loopback checks, listening/bindable probes.

TensorFlow's gRPC server listens on every interface of its network namespace at the port the
cluster names for its task, so a port counts as taken when anything listens on it or when it
cannot be bound on the wildcard address.

Example::

    from tag.backend.runtime.ports import free_ports, is_loopback, port_bindable

    ports = free_ports(2)                          # e.g. [40123, 40125]
    assert is_loopback("127.0.0.1") and all(port_bindable(p) for p in ports)
"""
from __future__ import annotations

import errno
import ipaddress
import socket


def free_ports(n: int, address: str = "127.0.0.1") -> list[int]:
    """N TCP ports on ADDRESS that nothing listens on right now (the OS picks them)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind((address, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def is_loopback(address: str) -> bool:
    """Does ADDRESS (a name or an IP) resolve to loopback addresses only?"""
    if address in ("localhost", "ip6-localhost"):
        return True
    try:
        infos = socket.getaddrinfo(address, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def port_listening(address: str, port: int, timeout: float = 0.2) -> bool:
    """Does something accept TCP connections at ADDRESS:PORT (within TIMEOUT seconds)?"""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_bindable(port: int) -> bool:
    """Can a server bind PORT on every interface (as TF's gRPC server does)?"""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            return True
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
            continue  # e.g. IPv6 disabled: try IPv4
        finally:
            s.close()
    return True
