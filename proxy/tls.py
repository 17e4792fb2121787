"""TLS on both sides: the listener's certificate (`server.tls_certfile`/`tls_keyfile`,
served by uvicorn) and the CA that `https://` backends are verified against
(`upstream.tls_ca_file`: one `ssl.SSLContext` for the relay, the scrapes and ELDR's
prefill leg). Both are checked when the config is (a file that does not load stops
the proxy at start, naming the key)."""

from __future__ import annotations

import ssl


def check_server_tls(certfile: str | None, keyfile: str | None) -> None:
    """Raise ValueError (naming the key) if the certificate and key do not load."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("server.tls_certfile and server.tls_keyfile: set both or neither")
    if certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"server.tls_certfile/tls_keyfile: cannot load: {exc}") from None


def upstream_context(ca_file: str | None) -> ssl.SSLContext | None:
    """The context verifying `https://` backends with `ca_file` (`upstream.tls_ca_file`);
    None: the clients' defaults (the system's CAs). Raises ValueError if it does not load."""
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"upstream.tls_ca_file: cannot load: {exc}") from None
