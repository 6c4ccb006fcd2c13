"""Every read path against the reference reader (tests/reference.py), on random datasets.

Each example writes a random dataset (tests/diff_datasets.py: 1-64 fields of every
codec, sizes 0 B to 8 MiB across the 1 MiB and 4 MiB boundaries, odd keys, gzip and
zstd shards, with and without manifest and offset index), reads it with the reference
(CPython ``tarfile``, ``json``, ``gzip``, ``numpy.load``, Pillow) and asserts that every
read path of shardflow yields the same decoded samples and counts: ``ShardDataset`` in
order and shuffled, ``IndexedShardDataset`` by index, local, ``memory://``, HTTP and S3,
through ``shardflow.loader`` with 0 and 2 workers, resumed at a random batch, with the
fast paths on and off (tests/fastpaths.py).

Examples are fixed (``derandomize``) so CI is deterministic; the dataset of a failing
example is printed as its :class:`Spec` and replays with
``SHARDFLOW_DIFF_REPLAY='<spec json>'``. ``SHARDFLOW_DIFF_EXAMPLES`` scales the number of
examples, ``SHARDFLOW_DIFF_RANDOM=1`` draws new ones (docs/testing.md).
"""

from __future__ import annotations

import itertools
import random
import math
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st

from shardflow import IndexedShardDataset, ShardDataset
from shardflow.codecs import DecodeOptions
from shardflow.errors import SampleError, ShardflowError
from shardflow.loading.shardloader import loader as make_loader
from shardflow.storage import IOOptions
from tests.diff_datasets import BOUNDARIES, COMPRESSIONS, LAYOUTS, MIB, WRITERS, Spec, spec_from_json, write_dataset, writer_compresses
from tests.fastpaths import FAST_PATHS, FastSetting, fast_paths
from tests.helpers import assert_resumes
from tests.reference import RefSample, expected, has_offset_index, normalize_sample, read_dataset, shard_files
from tests.servers import FileHTTPServer

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.timeout(300),
]

# --------------------------------------------------------------------------- settings

settings.register_profile(
    "shardflow-diff",
    derandomize=os.environ.get("SHARDFLOW_DIFF_RANDOM", "") in ("", "0"),
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_BASE = 20  # examples of the main local test at the default size
_EXAMPLES = int(os.environ.get("SHARDFLOW_DIFF_EXAMPLES", _BASE))


def budget(n: int, shrink: bool = True) -> settings:
    """The suite's profile with ``n`` examples at the default size, scaled by ``SHARDFLOW_DIFF_EXAMPLES``.

    ``shrink=False`` for tests that start DataLoader workers: shrinking a failure there takes
    minutes; the failing example is reported as found (its spec replays it).
    """
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p != Phase.shrink)
    return settings(settings.get_profile("shardflow-diff"), max_examples=max(1, math.ceil(n * _EXAMPLES / _BASE)),
                    phases=phases)


# --------------------------------------------------------------------------- datasets

_COMPRESSIONS = tuple(c for c in COMPRESSIONS if c != "zstd-writer" or writer_compresses())
# ("zstd-writer" examples need ShardWriter(compression=...), on main since the zstd merge.)


def specs(*, big: bool = True, most: int = 12) -> st.SearchStrategy[Spec]:
    """Random dataset specs; a tenth of them with large fields (when ``big``)."""
    replay = os.environ.get("SHARDFLOW_DIFF_REPLAY")
    if replay:
        return st.just(spec_from_json(replay))
    large = st.integers(0, 9).flatmap(
        lambda r: st.lists(st.sampled_from(BOUNDARIES), min_size=1, max_size=2).map(tuple) if r == 0 and big else st.just(())
    )
    return st.builds(
        Spec,
        seed=st.integers(0, 2**32 - 1),
        samples=st.integers(1, most),
        max_count=st.integers(1, 6),
        layout=st.sampled_from(LAYOUTS),
        compression=st.sampled_from(("none", "none") + _COMPRESSIONS[1:]),
        big=large,
        wide=st.integers(0, 3).map(lambda r: r == 0),
        writer=st.sampled_from(("shardflow", "shardflow") + WRITERS[1:]),
    )


# datasets across the boundaries, each forced once into the tests that read large fields
ACROSS = Spec(seed=7, samples=4, max_count=2, layout="indexed", big=BOUNDARIES)
ACROSS_SMALL = Spec(seed=8, samples=3, max_count=2, layout="indexed", big=(MIB - 1, MIB, 4 * MIB + 1))
ACROSS_NPY = Spec(seed=10, samples=2, max_count=1, layout="no_index", big=(MIB - 1, MIB, 4 * MIB + 1), big_kind="npy")
ACROSS_BARE = Spec(seed=9, samples=3, max_count=2, layout="bare", compression="gzip", big=(MIB, 4 * MIB))
ACROSS_FOREIGN = Spec(seed=11, samples=5, max_count=3, layout="indexed", big=(MIB, 4 * MIB - 1), writer="tarfile-pax")

FAST = st.sampled_from((True, False, True, False, *FAST_PATHS))
"""Fast paths all on, all off, or one of them off (tests/fastpaths.py)."""

_counter = itertools.count()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("differential")


@contextmanager
def dataset(spec: Spec, workdir: Path) -> Iterator[tuple[Path, list[RefSample], list[int]]]:
    """``spec``'s dataset written and read by the reference: ``(folder, samples, per-shard counts)``."""
    note(f"dataset {spec!r}; replay: SHARDFLOW_DIFF_REPLAY='{spec.to_json()}'")
    folder = workdir / f"d{next(_counter)}"
    try:
        write_dataset(spec, folder)
        samples, counts = read_dataset(folder)
        yield folder, samples, counts
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def want(samples: list[RefSample], mode: str | None = "numpy") -> list[tuple]:
    return [normalize_sample(expected(s, mode)) for s in samples]


def got(items: Iterable[dict[str, Any]]) -> list[tuple]:
    return [normalize_sample(s) for s in items]


def _short(sample: tuple) -> str:
    fields = dict(sample)
    return f"key {fields.get('__key__')!r}, fields {sorted(k for k in fields if not k.startswith('__'))}"


def assert_same(actual: list[tuple], wanted: list[tuple], what: str) -> None:
    """``actual == wanted``, reported by the first differing sample and field (no dump of big fields)."""
    for i, (a, w) in enumerate(zip(actual, wanted)):
        if a != w:
            da, dw = dict(a), dict(w)
            diff = sorted(k for k in set(da) | set(dw) if da.get(k) != dw.get(k))
            detail = {k: (repr(da.get(k))[:200], repr(dw.get(k))[:200]) for k in diff[:3]}
            raise AssertionError(f"{what}: sample {i} differs: got {_short(a)}, want {_short(w)}; "
                                 f"differing entries (got, want): {detail}")
    assert len(actual) == len(wanted), f"{what}: {len(actual)} samples, the reference reads {len(wanted)}"


def assert_same_multiset(actual: list[tuple], wanted: list[tuple], what: str) -> None:
    assert_same(sorted(actual), sorted(wanted), what)


def assert_shards_in_order(actual: list[tuple], wanted: list[tuple], what: str) -> None:
    """Each shard's samples in file order, the shards interleaved in any way: without a manifest,
    DataLoader workers take whole shards (README: split whole over ranks and workers)."""
    def by_shard(items: list[tuple]) -> dict[str, list[tuple]]:
        out: dict[str, list[tuple]] = {}
        for s in items:
            out.setdefault(dict(s)["__url__"], []).append(s)
        return out

    mine, theirs = by_shard(actual), by_shard(wanted)
    assert sorted(mine) == sorted(theirs), f"{what}: shards {sorted(mine)}, the reference has {sorted(theirs)}"
    for shard in theirs:
        assert_same(mine[shard], theirs[shard], f"{what}, shard {shard}")


def sized(spec: Spec) -> bool:
    return spec.layout != "bare"


# --------------------------------------------------------------------------- the reference itself


@budget(40)
@given(spec=specs())
@example(spec=ACROSS_SMALL)
def test_reference_reads_what_was_written(spec: Spec, workdir: Path) -> None:
    """The reference reads back the writer's samples (keys, order, bytes and values), so it can judge the rest."""
    from tests.diff_datasets import samples_of
    from tests.reference import decode, normalize

    written = samples_of(spec)
    with dataset(spec, workdir) as (folder, samples, counts):
        assert [s.key for s in samples] == [w["__key__"] for w in written]
        assert sum(counts) == spec.samples
        assert len(counts) == math.ceil(spec.samples / spec.max_count)
        for ref, sample in zip(samples, written):
            assert sorted(ref.fields) == sorted(k for k in sample if k != "__key__")
            for name, value in sample.items():
                if name == "__key__":
                    continue
                stored = ref.fields[name]
                decoded = decode(name, stored)  # every field decodes by the reference's rules
                if isinstance(value, bytes):
                    assert stored == value, (ref.key, name)
                elif name.endswith((".png", ".webp", ".jpg", ".jpeg")) or name in ("png", "webp", "jpg", "jpeg"):
                    raise AssertionError(f"{name}: images are given as bytes")
                else:
                    assert normalize(decoded) == normalize(value), (ref.key, name)


def test_a_sample_without_fields_is_refused(tmp_path: Path) -> None:
    """The 0-field end of the range: the writer refuses the sample and writes nothing of it."""
    from shardflow import ShardWriter

    with ShardWriter(str(tmp_path / "d" / "train-%06d.tar"), max_count=2) as w:
        w.write({"__key__": "a", "txt": "x"})
        with pytest.raises(SampleError, match="no fields"):
            w.write({"__key__": "empty"})
        w.write({"__key__": "b", "txt": "y"})
    samples, counts = read_dataset(tmp_path / "d")
    assert [s.key for s in samples] == ["a", "b"] and counts == [2]


# --------------------------------------------------------------------------- local streams

DECODES = ("numpy", "torch", None, "simplejpeg")


def _decode_option(decode: str | None) -> Any:
    return DecodeOptions(image="numpy", jpeg_decoder="simplejpeg") if decode == "simplejpeg" else decode


@budget(20)
@given(spec=specs(), decode=st.sampled_from(DECODES), block=st.sampled_from((4 << 20, 4 << 20, 65536, 1000)),
       fast=FAST)
@example(spec=ACROSS, decode="numpy", block=4 << 20, fast=True)
@example(spec=ACROSS, decode="numpy", block=4 << 20, fast=False)
@example(spec=ACROSS_BARE, decode=None, block=65536, fast=True)
@example(spec=ACROSS_NPY, decode="numpy", block=4 << 20, fast=True)
@example(spec=ACROSS_FOREIGN, decode="numpy", block=65536, fast=True)
def test_stream_in_order(spec: Spec, decode: str | None, block: int, fast: FastSetting, workdir: Path) -> None:
    """``ShardDataset(shuffle=False)`` yields the reference's samples in stored order, and ``len()`` its count."""
    with dataset(spec, workdir) as (folder, samples, counts), fast_paths(fast):
        ds = ShardDataset(folder, decode=_decode_option(decode), io=IOOptions(block_size=block))
        mode = "numpy" if decode == "simplejpeg" else decode
        assert_same(got(ds), want(samples, mode), f"ShardDataset in order (decode={decode}, block={block}, fast={fast})")
        assert ds.stats["samples"] == len(samples) and not ds.stats["skipped"], dict(ds.stats)
        if sized(spec):
            assert len(ds) == sum(counts)


@budget(15)
@given(spec=specs(big=False), seed=st.integers(0, 2**31), buffer=st.sampled_from((True, 1, 3, 100)), fast=FAST)
def test_stream_shuffled(spec: Spec, seed: int, buffer: Any, fast: FastSetting, workdir: Path) -> None:
    """Shuffled: the reference's samples, each once; the same order again from a fresh dataset with the same seed."""
    with dataset(spec, workdir) as (folder, samples, counts), fast_paths(fast):
        first = got(ShardDataset(folder, shuffle=buffer, seed=seed, decode=None))
        assert_same_multiset(first, want(samples, None), f"shuffled (seed={seed}, buffer={buffer})")
        again = got(ShardDataset(folder, shuffle=buffer, seed=seed, decode=None))
        assert_same(again, first, "a second run with the same seed")


@budget(20)
@given(spec=specs(), decode=st.sampled_from(("numpy", None)), fast=FAST, order=st.randoms(use_true_random=False))
@example(spec=ACROSS_SMALL, decode="numpy", fast=True, order=random.Random(0))
def test_indexed_by_index(spec: Spec, decode: str | None, fast: FastSetting, order: Any, workdir: Path) -> None:
    """``IndexedShardDataset[i]`` is the reference's sample ``i`` in any order (negative ``i`` from the end);
    a dataset it cannot serve (no manifest, no offset index, compressed) is refused with an error saying why."""
    with dataset(spec, workdir) as (folder, samples, counts), fast_paths(fast):
        if not has_offset_index(folder):  # no manifest, no index, or compressed shards without one
            with pytest.raises(ShardflowError, match="index|compressed"):
                IndexedShardDataset(folder, decode=decode)[0]
            return
        ds = IndexedShardDataset(folder, decode=decode)
        assert len(ds) == sum(counts)
        wanted = want(samples, decode)
        indices = list(range(len(ds)))
        order.shuffle(indices)
        for i in indices:
            j = i - len(ds) if order.random() < 0.3 else i
            assert_same(got([ds[j]]), [wanted[i]], f"IndexedShardDataset[{j}]")


@budget(15)
@given(spec=specs(big=False), world=st.integers(2, 3), partial=st.sampled_from(("pad", "drop")),
       shuffle=st.sampled_from((False, 3)), fast=FAST)
def test_ranks(spec: Spec, world: int, partial: str, shuffle: Any, fast: FastSetting, workdir: Path) -> None:
    """Split over ``world`` ranks: with a manifest every rank gets the same count and together they read
    the reference's samples once each, plus the padding (copies of real samples) or minus the dropped
    remainder; without one, whole shards per rank and every sample once."""
    with dataset(spec, workdir) as (folder, samples, counts), fast_paths(fast):
        n = len(samples)
        if (sized(spec) and partial == "drop" and n < world) or (not sized(spec) and len(counts) < world):
            with pytest.raises(ShardflowError, match="no data|no shard|would get 0"):  # a rank would get nothing
                list(ShardDataset(folder, rank=world - 1, world_size=world, partial=partial, decode=None))
            return
        per_rank = [got(ShardDataset(folder, rank=r, world_size=world, partial=partial, shuffle=shuffle,
                                     seed=spec.seed, decode=None)) for r in range(world)]
        everything = [s for part in per_rank for s in part]
        reference = want(samples, None)
        if not sized(spec):
            assert_same_multiset(everything, reference, f"{world} ranks, no manifest")
            return
        sizes = {len(part) for part in per_rank}
        want_size = math.ceil(n / world) if partial == "pad" else n // world
        assert sizes == {want_size}, f"{world} ranks, partial={partial}: counts {sorted(len(p) for p in per_rank)}"
        distinct = set(everything)
        assert distinct <= set(reference), f"{world} ranks: a sample the reference does not have"
        if partial == "pad":
            assert distinct == set(reference), f"{world} ranks, pad: samples missing"
            assert len(everything) - len(distinct) == world * want_size - n
        else:
            assert len(distinct) == len(everything) == world * want_size, f"{world} ranks, drop: a sample twice"


# --------------------------------------------------------------------------- remote stores


@pytest.fixture(scope="module")
def http_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileHTTPServer]:
    """One HTTP file server for the module (not one per example)."""
    with FileHTTPServer(tmp_path_factory.mktemp("diff-http")) as srv:
        yield srv


@contextmanager
def uploaded(where: str, folder: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """The dataset folder copied to ``where`` (``memory``, ``http``, ``s3``): ``(base URL, storage options)``."""
    name = f"{folder.name}-{next(_counter)}"
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if where == "http":
        srv = request.getfixturevalue("http_root")
        shutil.copytree(folder, srv.root / name)
        try:
            yield f"{srv.url}/{name}", {}
        finally:
            shutil.rmtree(srv.root / name, ignore_errors=True)
        return
    import fsspec

    if where == "memory":
        fs, base, options = fsspec.filesystem("memory"), f"memory://diff/{name}", {}
    else:
        moto = request.getfixturevalue("moto_server")
        fs, base, options = moto.fs(), moto.url(f"diff/{name}"), moto.storage_options
    for p in files:
        fs.pipe(f"{base}/{p.name}", p.read_bytes())
    try:
        yield base, options
    finally:
        fs.rm(f"{base}/", recursive=True)


def remote_source(base: str, folder: Path, spec: Spec) -> str | list[str]:
    """The manifest URL, or for a bare dataset the shard URLs in order."""
    if sized(spec):
        return f"{base}/shardflow.json"
    return [f"{base}/{p.name}" for p in shard_files(folder)]


@pytest.mark.parametrize("where", ["memory", "http", "s3"])
@budget(6)
@given(spec=specs(most=8), fast=FAST, cache=st.booleans(), at=st.floats(0, 1))
@example(spec=ACROSS_SMALL, fast=True, cache=False, at=0.5)
def test_remote(where: str, spec: Spec, fast: FastSetting, cache: bool, at: float, workdir: Path,
                request: pytest.FixtureRequest) -> None:
    """From ``memory://``, HTTP and S3 (through the local shard cache or not): the reference's samples in
    order (twice: a cache's misses, then its hits), shuffled, resumed at a random batch (seeking into the
    remote shards with the offset index), and by index when indexed."""
    with dataset(spec, workdir) as (folder, samples, counts), uploaded(where, folder, request) as (base, options), \
            fast_paths(fast):
        source = remote_source(base, folder, spec)
        io = IOOptions(storage_options=options, cache_dir=str(workdir / f"cache-{next(_counter)}") if cache else None)
        for attempt in ("first", "second"):
            assert_same(got(ShardDataset(source, io=io)), want(samples), f"{where}: in order, {attempt} read, cache={cache}")
        shuffled = got(ShardDataset(source, shuffle=3, seed=spec.seed, decode=None, io=io))
        assert_same_multiset(shuffled, want(samples, None), f"{where}: shuffled")
        if sized(spec):
            def make() -> Any:
                ds = ShardDataset(source, shuffle=3, seed=spec.seed, decode=None, io=io)
                return make_loader(ds, batch_size=2, collate_fn=as_list)

            k = min(math.ceil(len(samples) / 2), int(at * (math.ceil(len(samples) / 2) + 1)))
            record, _ = assert_resumes(make, lambda ldr: (flat([b]) for b in ldr), k, check_next_epoch=False)
            assert_same_multiset([s for b in record for s in _untuple(b)], want_native(samples, None), f"{where}: resumed")
        if has_offset_index(folder):
            indexed = IndexedShardDataset(source, io=IOOptions(storage_options=options))
            assert len(indexed) == sum(counts)
            assert_same(got(indexed[i] for i in reversed(range(len(indexed)))), want(samples)[::-1], f"{where}: by index")
        if cache:
            shutil.rmtree(io.cache_dir, ignore_errors=True)


# --------------------------------------------------------------------------- the loader


def as_list(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A collate_fn that keeps a batch as its list of samples (compared sample by sample)."""
    return samples


def flat(batches: Iterable[list[dict[str, Any]]]) -> list[tuple]:
    """The normalized samples of a loader's batches, arrays in native byte order: numpy pickles a
    big-endian array as a native one (pickle protocol < 5, which DataLoader workers use), the
    same values with another dtype; that is numpy's doing, not a read path's."""
    return [normalize_sample(_native(s)) for batch in batches for s in batch]


def _native(sample: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    return {k: v.astype(v.dtype.newbyteorder("=")) if isinstance(v, np.ndarray) and not v.dtype.isnative else v
            for k, v in sample.items()}


def want_native(samples: list[RefSample], mode: str | None = "numpy") -> list[tuple]:
    return [normalize_sample(_native(expected(s, mode))) for s in samples]


def _loader(folder: Path, *, shuffle: Any, seed: int, batch_size: int, workers: int, decode: str | None = "numpy") -> Any:
    ds = ShardDataset(folder, shuffle=shuffle, seed=seed, decode=decode)
    return make_loader(ds, batch_size=batch_size, num_workers=workers, collate_fn=as_list, timeout=120 if workers else 0)


@pytest.mark.parametrize("workers", [0, 2])
@budget(5, shrink=False)
@given(spec=specs(most=16), shuffle=st.sampled_from((False, 4, True)), batch_size=st.integers(1, 5),
       fast=FAST)
@example(spec=ACROSS_SMALL, shuffle=False, batch_size=2, fast=True)
def test_loader(workers: int, spec: Spec, shuffle: Any, batch_size: int, fast: FastSetting, workdir: Path) -> None:
    """``shardflow.loader`` with 0 and 2 workers: the reference's samples (in order unless shuffled), in the
    order of the dataset iterated alone, in batches of ``batch_size``."""
    with dataset(spec, workdir) as (folder, samples, counts), fast_paths(fast):
        ldr = _loader(folder, shuffle=shuffle, seed=spec.seed, batch_size=batch_size, workers=workers)
        batches = list(ldr)
        assert all(1 <= len(b) <= batch_size for b in batches)
        if sized(spec):
            assert len(ldr) == len(batches)
        items = flat(batches)
        if shuffle is False and (sized(spec) or workers == 0):
            assert_same(items, want_native(samples), f"loader, {workers} workers, in order")
        elif shuffle is False:
            assert_shards_in_order(items, want_native(samples), f"loader, {workers} workers, no manifest")
        else:
            assert_same_multiset(items, want_native(samples), f"loader, {workers} workers, shuffled")
            if sized(spec) or workers == 0:  # (without a manifest, workers take whole shards: another order)
                alone = flat([ShardDataset(folder, shuffle=shuffle, seed=spec.seed)])
                assert_same(items, alone, f"loader, {workers} workers, against the dataset iterated alone")


@pytest.mark.parametrize("workers", [0, 2])
@budget(5, shrink=False)
@given(spec=specs(big=False, most=16), shuffle=st.sampled_from((False, 4, True)), batch_size=st.integers(1, 4),
       at=st.floats(0, 1), fast=FAST)
def test_resume(workers: int, spec: Spec, shuffle: Any, batch_size: int, at: float, fast: FastSetting, workdir: Path) -> None:
    """``state_dict()`` after a random number of batches, a fresh dataset and loader, ``load_state_dict``, the rest:
    the concatenation is the uninterrupted run, which is the reference's samples."""
    with dataset(spec, workdir) as (folder, samples, counts), fast_paths(fast):

        def make() -> Any:
            return _loader(folder, shuffle=shuffle, seed=spec.seed, batch_size=batch_size, workers=workers, decode=None)

        n_batches = math.ceil(len(samples) / batch_size)
        k = min(n_batches, int(at * (n_batches + 1)))
        note(f"resumed after {k} of {n_batches} batches")
        record, _ = assert_resumes(make, lambda ldr: (flat([b]) for b in ldr), k, check_next_epoch=False)
        items = [s for batch in record for s in _untuple(batch)]
        if shuffle is False and (sized(spec) or workers == 0):
            assert_same(items, want_native(samples, None), "uninterrupted loader run")
        elif shuffle is False:
            assert_shards_in_order(items, want_native(samples, None), "uninterrupted loader run, no manifest")
        else:
            assert_same_multiset(items, want_native(samples, None), "uninterrupted loader run")


def _untuple(batch: Any) -> list[tuple]:
    """A batch of normalized samples back from ``helpers.canonical`` (which turns tuples into lists)."""
    def back(v: Any) -> Any:
        return tuple(back(x) for x in v) if isinstance(v, list) else v

    return [back(s) for s in batch]


# --------------------------------------------------------------------------- regressions found by the suite


def test_npy_field_of_a_mib_or_more_decodes_from_a_stream(tmp_path: Path) -> None:
    """A ``.npy`` member of 1 MiB or more that spans read chunks arrives from the tar reader as a bytearray
    (never joined); its decode must not hash it (issue 21, case 2: ``TypeError: unhashable type: 'bytearray'``)."""
    import numpy as np

    from shardflow import ShardWriter

    arr = np.arange(MIB, dtype=np.uint8)
    with ShardWriter(str(tmp_path / "d" / "train-%06d.tar"), max_count=1) as w:
        w.write({"__key__": "a", "npy": arr})
    # read in 64 KiB blocks: the member spans chunks, so it is gathered into a bytearray
    [sample] = list(ShardDataset(tmp_path / "d", io=IOOptions(block_size=1 << 16)))
    np.testing.assert_array_equal(sample["npy"], arr)


def test_fast_paths_off_take_the_general_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fast_paths(False)`` really leaves the fast variants unused: the bulk header walk's inner step and
    the JPEG decode without ``Image.open`` are called with them on, never with them off."""
    import numpy as np

    from shardflow import ShardWriter
    from shardflow.codecs import image
    from shardflow.format import spans

    calls = {"plain": 0, "jpeg": 0}

    def spy(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(spans, "plain_members", spy("plain", spans.plain_members))
    monkeypatch.setattr(image, "decode_jpeg_pillow", spy("jpeg", image.decode_jpeg_pillow))
    rng = np.random.default_rng(0)
    with ShardWriter(str(tmp_path / "d" / "train-%06d.tar"), max_count=100, index=False) as w:
        for i in range(20):
            w.write({"__key__": f"k{i:03d}", "jpg": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "cls": i})
    for on in (True, False):
        calls.update(plain=0, jpeg=0)
        with fast_paths(on):
            assert [s["cls"] for s in ShardDataset(tmp_path / "d")] == list(range(20))
        assert (calls["plain"] > 0, calls["jpeg"] > 0) == (on, on), (on, calls)
