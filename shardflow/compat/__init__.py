"""Every private name of a dependency that shardflow uses, one module per dependency.

:mod:`.torch` (storage use counts, shared-memory allocation, the DataLoader's pinning
and worker shutdown), :mod:`.numpy` (the ``.npy`` 3.0 header reader),
:mod:`.gcsfs` (request headers and session), :mod:`.pyg` (graph storages and batch
slices), :mod:`.fsspec` (a URL's path, s3fs's request call) and :mod:`.aio` (aiohttp's
request arguments, aiobotocore's cached credentials). Each says what it needs in
``REQUIRED`` and falls back to a public path where there is one; ``tests/test_compat.py``
fails loudly, naming the name, when an upgrade moves one.
"""
