"""`admin.backend_allowlist` (proxy/allowlist.py): networks and host names, and an
address matched as what it is, however it is written."""

from __future__ import annotations

import pytest

from proxy.allowlist import allowlist_entry, backend_allowed


@pytest.mark.parametrize(("allowlist", "url", "allowed"), [
    (["10.0.0.0/8"], "http://10.1.2.3:8000", True),
    (["10.0.0.0/8"], "http://11.1.2.3:8000", False),
    (["gpu-1.internal"], "http://GPU-1.internal.:8000", True),
    (["gpu-1.internal"], "http://gpu-2.internal:8000", False),
    (["fd00::/8"], "http://[fd00::1]:8000", True),
    # an IPv4-mapped IPv6 address is the IPv4 address: an IPv6 entry does not admit it
    # (second review: `::/0` let `[::ffff:127.0.0.1]` through), an IPv4 entry does
    (["::/0"], "http://[::ffff:127.0.0.1]:22", False),
    (["127.0.0.0/8"], "http://[::ffff:127.0.0.1]:8000", True),
    (["10.0.0.0/8"], "http://[::ffff:169.254.169.254]/", False),
])
def test_addresses_are_matched_as_what_they_are(allowlist: list[str], url: str,
                                                allowed: bool) -> None:
    assert backend_allowed(allowlist, url) is allowed


def test_an_entry_is_a_network_or_a_host_name() -> None:
    assert str(allowlist_entry("10.0.0.0/8")) == "10.0.0.0/8"
    assert allowlist_entry("GPU-1.Internal.") == "gpu-1.internal"
    with pytest.raises(ValueError, match="neither a network nor a host name"):
        allowlist_entry("http://x")
