"""HTTPS for ``llmctl serve``: the TLS options checked before uvicorn starts.

uvicorn loads the key and certificate itself, but only once it serves, and a bad file
then ends in a traceback. ``tls_settings`` loads them first into an ``ssl.SSLContext``
the way uvicorn will, so a missing, unreadable or mismatched file is an ``OptionError``
naming the option and the file, before the model loads.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from llmctl.errors import OptionError


def tls_settings(options: dict[str, Any]) -> dict[str, Any]:
    """uvicorn's ``ssl_*`` keyword arguments for these options ({} for plain HTTP)."""
    certfile, keyfile = options.get("ssl_certfile"), options.get("ssl_keyfile")
    password, ca_certs = options.get("ssl_keyfile_password"), options.get("ssl_ca_certs")
    if not certfile and not keyfile:
        for name, value in (("ssl_keyfile_password", password), ("ssl_ca_certs", ca_certs)):
            if value:
                raise OptionError(
                    f"{name} is set but ssl_certfile and ssl_keyfile are not: HTTPS needs a "
                    "certificate and its key (--ssl-certfile FILE --ssl-keyfile FILE)"
                )
        return {}
    if not certfile or not keyfile:
        given, missing = (
            ("ssl_certfile", "ssl_keyfile") if certfile else ("ssl_keyfile", "ssl_certfile")
        )
        raise OptionError(
            f"{given} is set but {missing} is not: HTTPS needs both the certificate and "
            f"its private key (--{missing.replace('_', '-')} FILE)"
        )
    cert_text = _read_text("ssl_certfile", certfile)
    key_text = _read_text("ssl_keyfile", keyfile)
    if "-----BEGIN CERTIFICATE-----" not in cert_text:
        raise OptionError(f"ssl_certfile {certfile}: not a PEM certificate (no BEGIN CERTIFICATE)")
    if "PRIVATE KEY-----" not in key_text:
        raise OptionError(f"ssl_keyfile {keyfile}: not a PEM private key (no BEGIN PRIVATE KEY)")
    if "ENCRYPTED" in key_text and not password:
        raise OptionError(
            f"ssl_keyfile {keyfile} is encrypted: give its password with --ssl-keyfile-password"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A callable password: OpenSSL must never stop to prompt on the terminal.
        context.load_cert_chain(certfile, keyfile, password=lambda: (password or "").encode())
    except ssl.SSLError as exc:
        raise OptionError(_cert_chain_problem(certfile, keyfile, exc, bool(password))) from None
    settings: dict[str, Any] = {
        "ssl_certfile": certfile,
        "ssl_keyfile": keyfile,
        "ssl_keyfile_password": password or None,
    }
    if ca_certs:
        _read_text("ssl_ca_certs", ca_certs)
        try:
            context.load_verify_locations(ca_certs)
        except ssl.SSLError as exc:
            raise OptionError(
                f"ssl_ca_certs {ca_certs}: not PEM CA certificates ({exc.reason or exc})"
            ) from None
        settings |= {"ssl_ca_certs": ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return settings


def _read_text(name: str, path: str) -> str:
    file = Path(path)
    flag = "--" + name.replace("_", "-")
    if not file.exists():
        raise OptionError(f"{name} {path}: no such file (fix {flag})")
    if not file.is_file():
        raise OptionError(f"{name} {path}: not a file (fix {flag})")
    try:
        return file.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise OptionError(f"{name} {path}: cannot be read ({exc.strerror})") from None


def _cert_chain_problem(certfile: str, keyfile: str, exc: ssl.SSLError, has_password: bool) -> str:
    if exc.reason == "KEY_VALUES_MISMATCH":
        return (
            f"ssl_keyfile {keyfile} is not the private key of ssl_certfile {certfile}: "
            "give the key the certificate was made for"
        )
    if has_password:
        return (
            f"ssl_keyfile {keyfile} does not load with the ssl_keyfile_password given "
            f"(a wrong password, or a damaged key: {exc.reason or exc})"
        )
    return (
        f"ssl_certfile {certfile} and ssl_keyfile {keyfile} do not load as a PEM certificate "
        f"and its private key ({exc.reason or exc})"
    )
