"""HTTPS: ``llmctl serve`` with a certificate made here by trustme (a private CA).

The ``openai`` client that trusts the CA completes chats, streamed and whole; one that
does not is refused; with ``ssl_ca_certs`` the server also wants a client certificate
signed by that CA. Bad key or certificate files are a clear error before the model
loads, never a traceback.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.cli import run_llmctl
from tests.helpers.server_process import ServerProcess, start_server

trustme = pytest.importorskip("trustme", reason="pip install trustme (the test extra)")
from cryptography.hazmat.primitives import serialization  # noqa: E402  (trustme's dependency)

SERVE = ["demo", "--backend", "torch", "--max-batch-size", "4"]
QUIET = {"OMP_NUM_THREADS": "1"}


@dataclass
class Pki:
    ca: trustme.CA
    ca_file: Path
    cert_file: Path  # the server's certificate (for 127.0.0.1), then the chain
    key_file: Path

    def client_context(self, with_client_cert: bool = False) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if with_client_cert:
            self.ca.issue_cert("client@llmctl.test").configure_cert(context)
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    pki = Pki(ca, folder / "ca.pem", folder / "server.pem", folder / "server.key")
    ca.cert_pem.write_to_path(str(pki.ca_file))
    for i, blob in enumerate(server_cert.cert_chain_pems):
        blob.write_to_path(str(pki.cert_file), append=i > 0)
    server_cert.private_key_pem.write_to_path(str(pki.key_file))
    return pki


def _tls_args(pki: Pki) -> list[str]:
    return ["--ssl-certfile", str(pki.cert_file), "--ssl-keyfile", str(pki.key_file)]


@pytest.fixture(scope="module")
def https_server(pki: Pki) -> Iterator[ServerProcess]:
    # --no-web-ui here too, so this start also shows an API-only server has no page.
    args = [*SERVE, *_tls_args(pki), "--no-web-ui"]
    process = start_server(args, env=QUIET, tls=pki.client_context())
    try:
        yield process
    finally:
        process.stop()


def _openai(url: str, context: ssl.SSLContext | bool) -> openai.OpenAI:
    http = httpx.Client(verify=context, timeout=60)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", http_client=http, max_retries=0)


def test_a_client_trusting_the_ca_completes_chats_streamed_and_whole(
    https_server: ServerProcess, pki: Pki
) -> None:
    assert https_server.url.startswith("https://127.0.0.1:")
    client = _openai(https_server.url, pki.client_context())
    messages = [{"role": "user", "content": "Hello over TLS"}]
    whole = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0
    )
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    chunks = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content  # greedy: the same answer
    assert "Serving on https://127.0.0.1:" in https_server.log()


def test_a_client_without_the_ca_is_refused(https_server: ServerProcess) -> None:
    client = _openai(https_server.url, True)  # the system's CAs only
    with pytest.raises(openai.APIConnectionError) as refused:
        client.models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(refused.value.__cause__)


def test_plain_http_to_the_https_port_gets_no_answer(https_server: ServerProcess) -> None:
    plain = https_server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/v1/models", timeout=10)


def test_the_web_ui_option_turns_the_page_off(https_server: ServerProcess, pki: Pki) -> None:
    context = pki.client_context()
    page = httpx.get(f"{https_server.url}/", verify=context, timeout=10)
    assert page.status_code == 404
    docs = httpx.get(f"{https_server.url}/docs", verify=context, timeout=10)
    assert docs.status_code == 200  # the API docs stay


def test_chat_reaches_an_https_server_with_ca_cert(https_server: ServerProcess, pki: Pki) -> None:
    url = https_server.url
    ok = run_llmctl(
        "chat", "--url", url, "--ca-cert", str(pki.ca_file), "--max-tokens", "8", stdin="hi\n"
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()
    untrusted = run_llmctl("chat", "--url", url, stdin="hi\n")
    assert untrusted.returncode == 1
    assert "not trusted" in untrusted.stderr and "--ca-cert" in untrusted.stderr
    assert "Traceback" not in untrusted.stderr
    not_a_ca = run_llmctl("chat", "--url", url, "--ca-cert", str(pki.key_file), stdin="hi\n")
    assert not_a_ca.returncode == 1
    assert "not a readable PEM CA certificate" in not_a_ca.stderr


def test_with_ssl_ca_certs_a_client_needs_a_certificate(pki: Pki) -> None:
    args = [*SERVE, *_tls_args(pki), "--ssl-ca-certs", str(pki.ca_file)]
    process = start_server(args, env=QUIET, tls=pki.client_context(with_client_cert=True))
    try:
        without = _openai(process.url, pki.client_context())
        with pytest.raises(openai.APIConnectionError):
            without.models.list()
        with_cert = _openai(process.url, pki.client_context(with_client_cert=True))
        answer = with_cert.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert answer.usage.completion_tokens == 4
        other_ca = trustme.CA()  # a certificate the server's CA did not sign
        context = pki.client_context()
        other_ca.issue_cert("intruder@llmctl.test").configure_cert(context)
        with pytest.raises(openai.APIConnectionError):
            _openai(process.url, context).models.list()
    finally:
        process.stop()


def _refusal(**options: str) -> str:
    """The message ``llmctl serve``'s TLS check gives for these options."""
    from llmctl.errors import OptionError
    from llmctl.server.tls import tls_settings

    with pytest.raises(OptionError) as refused:
        tls_settings(options)
    return str(refused.value)


def _encrypted_copy(key_file: Path, folder: Path, password: bytes) -> Path:
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    encrypted = folder / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(password),
        )
    )
    return encrypted


def test_bad_key_or_certificate_files_are_refused_by_name(pki: Pki, tmp_path: Path) -> None:
    cert, key = str(pki.cert_file), str(pki.key_file)
    missing = str(tmp_path / "nope.pem")
    message = _refusal(ssl_certfile=missing, ssl_keyfile=key)
    assert f"ssl_certfile {missing}: no such file" in message

    assert "ssl_keyfile is not" in _refusal(ssl_certfile=cert)
    assert "ssl_certfile and ssl_keyfile are not" in _refusal(ssl_ca_certs=str(pki.ca_file))

    other_key = tmp_path / "other.key"
    pki.ca.issue_cert("other.test").private_key_pem.write_to_path(str(other_key))
    message = _refusal(ssl_certfile=cert, ssl_keyfile=str(other_key))
    assert "is not the private key of ssl_certfile" in message

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert "not a PEM certificate" in _refusal(ssl_certfile=str(junk), ssl_keyfile=key)
    assert "not a PEM private key" in _refusal(ssl_certfile=cert, ssl_keyfile=str(junk))
    message = _refusal(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=str(junk))
    assert "ssl_ca_certs" in message and "not PEM CA certificates" in message

    folder = tmp_path / "dir.pem"
    folder.mkdir()
    assert "not a file" in _refusal(ssl_certfile=cert, ssl_keyfile=str(folder))

    encrypted = str(_encrypted_copy(pki.key_file, tmp_path, b"right"))
    message = _refusal(ssl_certfile=cert, ssl_keyfile=encrypted)
    assert "is encrypted" in message and "--ssl-keyfile-password" in message
    message = _refusal(ssl_certfile=cert, ssl_keyfile=encrypted, ssl_keyfile_password="wrong")
    assert "does not load with the ssl_keyfile_password" in message


def test_serve_with_a_bad_key_says_so_before_loading_the_model(pki: Pki, tmp_path: Path) -> None:
    other_key = tmp_path / "other.key"
    pki.ca.issue_cert("other.test").private_key_pem.write_to_path(str(other_key))
    args = ["--ssl-certfile", str(pki.cert_file), "--ssl-keyfile", str(other_key)]
    result = run_llmctl("serve", *SERVE, "--port", "0", *args, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())  # rich wraps long lines
    assert "Error: ssl_keyfile" in message
    assert "is not the private key of ssl_certfile" in message
    assert "KV cache" not in result.stderr + result.stdout  # no engine was built


def test_an_encrypted_key_with_its_password_passes_the_check(pki: Pki, tmp_path: Path) -> None:
    from llmctl.server.tls import tls_settings

    encrypted = _encrypted_copy(pki.key_file, tmp_path, b"right")
    options = {
        "ssl_certfile": str(pki.cert_file),
        "ssl_keyfile": str(encrypted),
        "ssl_keyfile_password": "right",
        "ssl_ca_certs": str(pki.ca_file),
    }
    settings = tls_settings(options)
    assert settings["ssl_keyfile_password"] == "right"
    assert settings["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert tls_settings({}) == {}
