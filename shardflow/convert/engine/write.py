"""``shardflow.write_shards(fn, inputs, dst)``: the general parallel, resumable writer.

What LitData's ``optimize(fn, inputs)`` is to LitData, for plain tar shards:
``fn`` turns one input into samples, workers (local processes or a Dask
cluster) run it, and the shards and manifest depend only on the inputs and
the options. Every converter of :mod:`shardflow.convert` is this same engine
(:func:`shardflow.convert.engine.engine.run_conversion`) with a ``fn`` of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ...errors import ConversionError, SampleError
from ...format.manifest import Manifest
from ...writing.writer import encode_sample_dict, graph_sizes
from .engine import ConvertOptions, run_conversion

__all__ = ["write_shards"]

_REPR_LIMIT = 200


def _describe(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _samples_of(result: Any, item: Any) -> Iterable[Mapping[str, Any]]:
    if result is None:
        return ()
    if isinstance(result, Mapping):
        return (result,)
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise ConversionError(
            f"input {_describe(item)}: fn returned a {type(result).__name__}; expected a sample dict, "
            "an iterable of sample dicts, or None"
        )
    return result


def _apply(inputs: list[Any], fn: Callable[[Any], Any]) -> Iterable[tuple[Any, ...]]:
    """Engine build step (worker): ``fn`` on each input, each sample encoded."""
    for item in inputs:
        try:
            for sample in _samples_of(fn(item), item):
                if not isinstance(sample, Mapping):
                    raise ConversionError(
                        f"input {_describe(item)}: fn gave a {type(sample).__name__} among its samples, not a dict"
                    )
                key, fields = encode_sample_dict(sample)
                sizes = graph_sizes(sample)
                yield (key, fields) if sizes is None else (key, fields, sizes)
        except ConversionError:
            raise
        except SampleError as e:
            raise SampleError(f"input {_describe(item)}: {e}", reason=e.reason) from e
        except Exception as e:
            raise ConversionError(f"fn failed on input {_describe(item)}: {type(e).__name__}: {e}") from e


def _name(fn: Callable[..., Any]) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"


def write_shards(
    fn: Callable[[Any], Any],
    inputs: Iterable[Any],
    dst: str,
    *,
    max_count: int = 10_000,
    max_bytes: int | None = None,
    group_size: int | None = None,
    workers: int | None = None,
    client: Any = None,
    prefix: str = "train",
    resume: bool = True,
    overwrite: bool = False,
    index: bool = True,
    compression: str | None = None,
    meta: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Write the samples that ``fn`` makes of each input into tar shards plus ``shardflow.json``.

    Example::

        def load(path):
            return {"__key__": path.stem, "jpg": path.read_bytes(), "cls": int(path.parent.name)}

        shardflow.write_shards(load, sorted(Path("photos").glob("*/*.jpg")), "out/", max_count=1000)

    Shard boundaries depend on the inputs and options only, never on ``workers`` or
    the engine: each task writes a group of ``group_size`` consecutive inputs into
    shards of its own (rule and names: :mod:`shardflow.convert.engine.groups`). With one
    sample per input the shards are full and numbered 0, 1, 2, ...; an ``fn`` that
    returns many samples per input gives several per group (or lower ``group_size``).

    Args:
        fn: ``fn(input)`` returns one sample (a dict with ``__key__`` and fields,
            encoded by the codec of each field's extension, as
            :meth:`shardflow.ShardWriter.write`), an iterable of samples, or
            None (no sample). Runs in worker processes: a module-level function
            (or a ``functools.partial`` of one) that pickles.
        inputs: any iterable (paths, row numbers, URLs, ...), consumed as a
            stream, one group at a time; each input must pickle, and its
            ``repr`` identifies it when resuming.
        dst: destination folder, local or fsspec URL.
        max_count: most samples per shard.
        max_bytes: shard size limit in bytes (None: no limit).
        group_size: inputs per task (default ``max_count``).
        workers: local worker processes (default one per CPU; 1 runs ``fn`` in
            this process). Not used with ``client``.
        client: a ``dask.distributed.Client``: run the tasks on its cluster;
            workers write straight to ``dst`` (which they must reach).
        prefix: shard name prefix.
        resume: keep the shards of finished groups of an earlier run into
            ``dst`` whose inputs (their ``repr``) and options are unchanged.
        overwrite: replace a dataset ``dst`` already holds that another
            conversion wrote (default: refuse it).
        index: write per-shard offset indexes (``<shard>.idx.npy``).
        compression: ``"zstd"`` writes ``.tar.zst`` shards, plain tar inside,
            as independent zstd frames with a frame table beside the offset
            index (seeking, random access and resumption as on ``.tar``; see
            :class:`~shardflow.ShardWriter`). None (default): plain ``.tar``.
        meta: the manifest's ``meta``.
        storage_options: fsspec options for a remote ``dst``.
        progress: ``progress(n)`` after every finished (or kept) group of ``n``
            samples.

    Returns:
        The manifest, shards in order.

    Raises:
        ConversionError: ``fn`` raised or returned something that is not
            samples (the message names the input and the shard); finished
            groups stay recorded, so a re-run resumes.
        SampleError: a sample is invalid (no ``__key__``, a key written twice
            in one shard, a value no codec encodes); names the input.
        DestinationExistsError: ``dst`` holds another dataset and not ``overwrite``.
    """
    options = ConvertOptions(
        max_count=max_count,
        max_bytes=max_bytes,
        group_size=group_size,
        prefix=prefix,
        workers=workers,
        resume=resume,
        overwrite=overwrite,
        storage_options=dict(storage_options or {}),
        index=index,
        compression=compression,
    )
    return run_conversion(
        dst,
        inputs,
        _apply,
        context=fn,
        meta=meta,
        options=options,
        progress=progress,
        identity={"converter": "write_shards", "fn": _name(fn)},
        client=client,
    )
