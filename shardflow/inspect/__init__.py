"""Looking at a dataset before training: a summary, the first samples, a full check.

- :func:`summarize` describes a dataset (shards, samples, bytes, fields and their
  codecs, class counts, graph statistics, the first keys, the manifest's meta) as
  a JSON-ready dict.
- :func:`head` reads the first samples (or samples spread over the dataset) as
  raw field bytes.
- :func:`verify` reads every shard, checks it against the manifest (sha256, byte
  size, sample count, offset index) and decodes every field, returning the
  problems found, each naming the shard, the key and the reason.

Shards are scanned in parallel by worker processes. Nothing here prints: the
command line (:mod:`shardflow.cli.inspect`, :mod:`shardflow.cli.verify`) formats
the results and draws the progress bar, which reaches this module as a
``progress(n)`` callback counting samples.

Modules: ``summary`` (:func:`summarize`), ``peek`` (:func:`head`), ``verification``
(:func:`verify`) and ``report`` (:class:`Problem`, :class:`VerifyReport`); ``pool``
runs one task per shard over processes, ``chunks`` hashes a shard as it is read,
``graph_stats`` reduces graph statistics.
"""

from __future__ import annotations

from .peek import head
from .pool import Progress
from .report import Problem, VerifyReport
from .summary import class_names, summarize
from .verification import verify

__all__ = ["Problem", "Progress", "VerifyReport", "class_names", "head", "summarize", "verify"]
