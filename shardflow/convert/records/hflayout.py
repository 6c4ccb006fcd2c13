"""The Hugging Face layout of a folder of Parquet files: its configs and splits.

A Hugging Face dataset repository keeps each *config* in a folder of its own and, in it, each
*split* as ``<split>-00000-of-00002.parquet`` files (``data/train-*.parquet`` for the default
config, ``extra/train-*.parquet`` for another). ``convert parquet`` converts one config and one
split at a time: two configs are different datasets (other columns, other classes) and two
splits (train, test) must never be merged by accident. :func:`check_layout` refuses a source
that holds several, naming them and what to pass instead; ``merge_configs=True``
(``--merge-configs``) merges the configs on purpose.

Files whose names do not follow the split pattern (a plain folder of ``part-*.parquet``, or
Hive partitions ``year=2020/``) are not a Hugging Face layout and are converted together.
"""

from __future__ import annotations

import posixpath
import re

from ... import storage
from ...errors import ConversionError

__all__ = ["check_layout", "SPLIT_FILE"]

SPLIT_FILE = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}\.parquet$")
"""A Hugging Face split file's name: ``train-00000-of-00002.parquet``."""


def check_layout(src: str, files: list[str], root: str, *, merge_configs: bool = False,
                 whole_folder: bool = True) -> None:  # fmt: skip
    """Refuse a source that holds several Hugging Face configs, or (a folder) several splits.

    Args:
        src: the source as the user gave it (for the messages).
        files: its Parquet files.
        root: the folder the files' config folders are relative to (``src`` for a folder,
            the part of a glob before its first wildcard).
        merge_configs: convert the files of several configs into one dataset on purpose.
        whole_folder: ``src`` is a folder (every split in it); a glob names its split itself.

    Raises:
        ConversionError: several configs (lists them, the folder of one to give instead and
            ``--merge-configs``), or a folder of several splits (lists them and a glob of
            one split of one config).
    """
    root = root.rstrip("/") + "/" if root else ""
    configs: dict[str, set[str]] = {}
    for f in files:
        m = SPLIT_FILE.match(posixpath.basename(f))
        if m:
            folder = posixpath.dirname(f[len(root):] if f.startswith(root) else f)
            configs.setdefault(folder, set()).add(m.group("split"))
    if len(configs) > 1 and not merge_configs:
        names = sorted(configs)
        shown = ", ".join(f"{n or '.'}/ ({', '.join(sorted(configs[n]))})" for n in names)
        raise ConversionError(
            f"{src} holds {len(names)} Hugging Face configs, each a folder of split files: {shown}; they are "
            f"different datasets: convert one at a time, giving its folder (such as "
            f"{storage.join_url(root or src, names[0]) if names[0] else src}), or pass --merge-configs "
            "(merge_configs=True) to convert them into one dataset"
        )
    splits = sorted({s for found in configs.values() for s in found})
    if whole_folder and len(splits) > 1:
        folder = next((n for n in sorted(configs) if splits[0] in configs[n]), "")
        pattern = f"{folder}/{splits[0]}-*.parquet" if folder else f"{splits[0]}-*.parquet"
        if merge_configs and len(configs) > 1:
            pattern = f"**/{splits[0]}-*.parquet"  # the configs are merged on purpose
        raise ConversionError(
            f"{src} holds the parquet files of {len(splits)} splits ({', '.join(splits)}); convert one: "
            f"give a glob such as {storage.join_url(root or src, pattern)}"
        )
