"""Secrets stay secret: no password, token, signature or storage-option secret in any error,
retry warning, repr, manifest or conversion record (issue 25, case a).

Every case reads through a real server on 127.0.0.1 and looks for the secret in everything
shardflow shows: the error's text and its whole printed traceback (causes included), every log
record, and every file written in the destination.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

import pytest

import shardflow
from shardflow import IOOptions, ShardDataset, Source
from shardflow.convert.engine.engine import ConvertOptions
from shardflow.convert.records.lines import convert_lines
from shardflow.errors import RemoteReadError, ShardflowError
from shardflow.errors import is_secret_name, redact, redact_options, redact_url

pytestmark = pytest.mark.timeout(60)

SECRETS = ("hunter2", "s3cr3t-value", "AKIAEXAMPLE", "sigvalue123", "tok3n", "apikey-42")


def shown(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def ours(caplog) -> list[str]:
    """shardflow's log lines (fsspec's own debug lines are fsspec's to redact)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("shardflow")]


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, (secret, text[:2000])


@pytest.mark.parametrize(
    "url, want",
    [
        ("https://alice:hunter2@h.example/x.tar", "https://***@h.example/x.tar"),
        ("https://tok3n@h.example/x.tar", "https://***@h.example/x.tar"),
        (
            "https://b.s3.amazonaws.com/x.tar?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIAEXAMPLE%2F1"
            "&X-Amz-Signature=sigvalue123&X-Amz-Expires=60",
            "https://b.s3.amazonaws.com/x.tar?X-Amz-Algorithm=AWS4&X-Amz-Credential=***"
            "&X-Amz-Signature=***&X-Amz-Expires=60",
        ),
        ("https://a.blob.core.windows.net/c/x.tar?sv=2020&sig=sigvalue123&se=1",
         "https://a.blob.core.windows.net/c/x.tar?sv=2020&sig=***&se=1"),
        ("http://h:8080/x.tar?token=tok3n&part=2", "http://h:8080/x.tar?token=***&part=2"),
        ("s3://bucket/x.tar", "s3://bucket/x.tar"),
        ("/data/train-000000.tar", "/data/train-000000.tar"),
    ],
)
def test_redact_url(url: str, want: str) -> None:
    assert redact_url(url) == want
    assert redact(f"reading {url} failed: boom") == f"reading {want} failed: boom"


def test_secret_option_names() -> None:
    for name in ("key", "secret", "token", "password", "aws_secret_access_key", "X-Api-Key", "Authorization",
                 "sas_token", "credential", "accountKey", "X-Amz-Signature", "sig", "access_token"):
        assert is_secret_name(name), name
    for name in ("endpoint_url", "region_name", "anon", "version_aware", "headers", "client_kwargs", "block_size"):
        assert not is_secret_name(name), name
    opts = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value", "client_kwargs": {"endpoint_url": "http://u:hunter2@h"},
            "headers": {"X-Api-Key": "apikey-42", "Accept": "x"}, "anon": False}
    assert redact_options(opts) == {"key": "***", "secret": "***", "client_kwargs": {"endpoint_url": "http://***@h"},
                                    "headers": {"X-Api-Key": "***", "Accept": "x"}, "anon": False}


def test_reprs_never_show_a_secret() -> None:
    opts = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value", "headers": {"X-Api-Key": "apikey-42"}}
    io = IOOptions(storage_options=opts)
    text = repr(io)
    assert_no_secret(text, str(io))
    assert "storage_options={'key': '***', 'secret': '***', 'headers': {'X-Api-Key': '***'}}" in text
    assert io.storage_options["secret"] == "s3cr3t-value"  # the options themselves are untouched
    source = Source("https://alice:hunter2@h.example/d/", storage_options=opts)
    assert_no_secret(repr(source), source.label)
    assert source.url == "https://alice:hunter2@h.example/d/"


def test_password_in_an_http_url_is_never_shown(flaky_http_server, caplog) -> None:
    srv = flaky_http_server
    srv.put("x.tar", b"\0" * 1024)
    srv.faults.fail_next = 100  # every request a 503: retried, warned, then an error
    url = srv.url.replace("http://", "http://alice:hunter2@") + "/x.tar"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(RemoteReadError) as info:
        list(ShardDataset(url, decode=None, io=IOOptions(retries=2, backoff=0.01)))
    assert "http://***@127.0.0.1" in str(info.value)
    warnings = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(warnings) == 2  # both retries were warned of, without the password
    assert_no_secret(shown(info.value), *ours(caplog))


def test_a_shardflow_error_redacts_any_url_in_its_message() -> None:
    err = ShardflowError("cannot read https://alice:hunter2@h/x.tar?sig=sigvalue123")
    assert str(err) == "cannot read https://***@h/x.tar?sig=***"


def test_a_convert_source_token_is_in_no_record(http_server, tmp_path: Path, caplog) -> None:
    http_server.put("lines.txt", b"one\ntwo\nthree\n")
    src = http_server.url.replace("http://", "http://alice:hunter2@") + "/lines.txt?token=tok3n"
    dst = tmp_path / "out"
    caplog.set_level(logging.DEBUG)
    manifest = convert_lines(src, str(dst), options=ConvertOptions(max_count=2, workers=1))
    assert manifest.num_samples == 3
    assert manifest.meta["source"] == http_server.url.replace("http://", "http://***@") + "/lines.txt?token=***"
    for path in dst.iterdir():
        assert_no_secret(path.read_bytes().decode("latin1"))
    # the same source with a fresh token is the same dataset: the re-run keeps every shard
    again = src.replace("tok3n", "tok3n-fresh")
    before = {p.name: p.read_bytes() for p in dst.iterdir() if p.suffix == ".tar"}
    convert_lines(again, str(dst), options=ConvertOptions(max_count=2, workers=1))
    assert {p.name: p.read_bytes() for p in dst.iterdir() if p.suffix == ".tar"} == before
    assert_no_secret(*ours(caplog))
    assert [s["txt"] for s in shardflow.ShardDataset(str(dst))] == ["one", "two", "three"]
