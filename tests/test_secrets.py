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


# ------------------------------------------------------------------ issue 32: what round 3 still found


def test_a_quote_in_a_url_password_does_not_end_its_redaction(http_server, caplog) -> None:
    """A ``'`` ended the URL pattern, so the rest of the password (and the password before it,
    the userinfo no longer having its ``@``) was printed in ShardNotFoundError."""
    url = http_server.url.replace("http://", "http://alice:hun'ter2@") + "/missing/train-000000.tar"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(FileNotFoundError) as info:
        list(ShardDataset(url, decode=None, io=IOOptions(retries=0, backoff=0.0)))
    assert "http://***@127.0.0.1" in str(info.value)
    assert "ter2" not in shown(info.value) and "alice" not in shown(info.value)
    assert redact(f"not found: {url!r}") == f'not found: "{redact_url(url)}"'  # repr quotes it with "
    assert not [m for m in ours(caplog) if "ter2" in m]


def test_an_azure_connection_string_and_header_pairs_are_masked_in_reprs() -> None:
    conn = ("DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=s3cr3t-value==;"
            "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;")
    opts = {"connection_string": conn, "headers": [("Authorization", "Bearer tok3n"), ("Accept", "x")],
            "client_kwargs": {"headers": (("X-Api-Key", "apikey-42"),)}}
    io = IOOptions(storage_options=opts)
    assert_no_secret(repr(io), str(io), repr(Source("az://c/d/", storage_options=opts)))
    assert redact_options(opts) == {
        "connection_string": conn.replace("s3cr3t-value==", "***"),
        "headers": [("Authorization", "***"), ("Accept", "x")],
        "client_kwargs": {"headers": (("X-Api-Key", "***"),)},
    }
    assert io.storage_options["connection_string"] == conn  # what is opened is untouched


def test_the_staging_debug_line_shows_no_password(flaky_http_server, tmp_path: Path, caplog) -> None:
    """A failed staged fetch logged ``staging <url> from block 0 failed`` with the URL whole."""
    from shardflow.storage.sharing import staged
    from shardflow.storage.sharing.staging import StagedOptions, StagingScope

    srv = flaky_http_server
    srv.put("obj.bin", b"x" * 4096)
    srv.faults.fail_next = 100
    url = srv.url.replace("http://", "http://alice:hunter2@") + "/obj.bin?token=tok3n"
    root = tmp_path / "area"
    root.mkdir(mode=0o700)
    caplog.set_level(logging.DEBUG)
    io = StagedOptions(retries=1, backoff=0.0, staging_scope=StagingScope(str(root), 0, 2))
    with pytest.raises(RemoteReadError) as info:
        b"".join(staged.staged_chunks(url, 0, None, io))
    staging_lines = [m for m in ours(caplog) if m.startswith("staging ")]
    assert staging_lines and all("http://***@127.0.0.1" in m for m in staging_lines), staging_lines
    assert_no_secret(shown(info.value), *ours(caplog))


def test_the_convert_lines_summary_shows_no_query_token(http_server, tmp_path: Path, capsys) -> None:
    from shardflow.cli import main

    http_server.put("lines.txt", b"one\ntwo\n")
    src = http_server.url + "/lines.txt?token=tok3n&part=1"
    assert main(["convert", "lines", src, str(tmp_path / "out"), "--workers", "1"]) == 0
    out = capsys.readouterr()
    assert f"lines of {http_server.url}/lines.txt?token=***&part=1 ->" in out.out
    assert_no_secret(out.out, out.err)


def test_a_manifest_meta_key_and_class_names_are_data_not_secrets(tmp_path: Path) -> None:
    """Redaction masked every value whose key looked secret, in the manifest too: parquet's
    ``meta.key`` (what a sample's key is) read ``***``, and so would a class named ``token``."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from shardflow.convert.records.parquet import convert_parquet

    table = pa.table({"key": ["a", "b"], "label": [0, 1]})
    pq.write_table(table, tmp_path / "t.parquet")
    manifest = convert_parquet(str(tmp_path / "t.parquet"), str(tmp_path / "out"),
                               options=ConvertOptions(workers=1))
    assert manifest.meta["key"] == "row number over the files in order, from 0"
    assert shardflow.ShardDataset(str(tmp_path / "out")).manifest.meta["key"] == manifest.meta["key"]
    assert [c["column"] for c in manifest.meta["columns"]] == ["key", "label"]


def test_classes_named_like_secrets_keep_their_indices(tmp_path: Path) -> None:
    from shardflow.convert.images.imagefolder import convert_imagefolder
    from tests.helpers import tiny_image

    for i, name in enumerate(("password", "token")):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "a.png").write_bytes(tiny_image("png", i))
    manifest = convert_imagefolder(str(tmp_path / "src"), str(tmp_path / "out"), options=ConvertOptions(workers=1))
    assert manifest.meta["class_to_idx"] == {"password": 0, "token": 1}
    assert sorted(s["cls"] for s in shardflow.ShardDataset(str(tmp_path / "out"))) == [0, 1]
