"""Which hosts the admin API may add backends at (`admin.backend_allowlist`): networks,
or host names compared as written (names are not resolved: a name's address can change).
Read by the config's validation and by the admin API (proxy/http/admin_guard.py)."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")


def allowlist_entry(entry: str) -> Network | str:
    """A network, or a host name (lower case); raises ValueError."""
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        pass
    name = entry.strip().lower().rstrip(".")
    if not _HOST_NAME.fullmatch(name):
        raise ValueError(f"admin.backend_allowlist: {entry!r} is neither a network nor a "
                         "host name")
    return name


def backend_allowed(allowlist: list[str], url: str) -> bool:
    """Whether `url`'s host is in `allowlist`: an IP address inside one of its networks,
    or a host name it lists (names are not resolved: a name's address can change)."""
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = \
            ipaddress.ip_address(host)
    except ValueError:
        address = None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # [::ffff:127.0.0.1] is 127.0.0.1, whatever it is written as
    for entry in map(allowlist_entry, allowlist):
        if isinstance(entry, str):
            if address is None and host == entry:
                return True
        elif address is not None and address.version == entry.version \
                and address in entry:
            return True
    return False
