"""Stored batching rules: the ``Data`` / ``HeteroData`` subclasses that answer the
``__cat_dim__`` / ``__inc__`` of a user's subclass recorded at encode time, and the
lazy import of PyG they need. The collate fast path reads the same rules."""

from __future__ import annotations

import threading
from typing import Any

from shardflow.compat.pyg import store_key
from shardflow.errors import SampleError, missing_dependency

__all__ = ["DEFAULT_RULE", "RULES_ATTR", "UNKNOWN_RULE", "import_pyg", "rule_classes", "stored_rules"]

RULES_ATTR = "_sf_rules"  # key in the instance __dict__ of the StoredRules* classes


# Markers in stored rules (strings: they survive pickling and never equal a real rule).
DEFAULT_RULE = "default"  # no stored cat_dim (numbers) or no stored rule: use the class default
UNKNOWN_RULE = "unknown"  # a custom increment that a batch or a separated graph cannot know


def import_pyg(purpose: str) -> Any:
    """Import ``torch_geometric.data`` or raise the ImportError naming the extra."""
    try:
        import torch_geometric.data as pyg_data
    except ImportError as exc:
        raise missing_dependency("torch_geometric", "graphs", purpose) from exc
    return pyg_data


_RULE_CLASSES: dict[str, type] = {}
_RULE_CLASSES_LOCK = threading.Lock()


def _store_key(store: Any) -> Any:
    return None if store is None else store_key(store)


def _stored_cat_dim(obj: Any, key: str, store: Any) -> Any:
    """The stored cat_dim of ``key``, or DEFAULT_RULE."""
    rules = obj.__dict__.get(RULES_ATTR)
    rule = rules.get((_store_key(store), key)) if rules else None
    return DEFAULT_RULE if rule is None else rule[0]


def _stored_inc(obj: Any, key: str, store: Any) -> Any:
    """The stored increment of ``key``, or DEFAULT_RULE; raises if it is not known."""
    rules = obj.__dict__.get(RULES_ATTR)
    rule = rules.get((_store_key(store), key)) if rules else None
    if rule is None:
        return DEFAULT_RULE
    if isinstance(rule[1], str):  # UNKNOWN_RULE
        raise SampleError(
            f"the custom increment of graph attribute {key!r} is unknown: this graph or "
            "batch was built from graphs decoded from a Data subclass with its own "
            "__inc__ (a graph taken out of a batch, or a batch of batches); collate "
            "the decoded graphs themselves instead"
        )
    return rule[1]


def _inherit_rules(target: Any, source: Any, batch_cls: type) -> None:
    """Pass stored rules on, as PyG passes on the first graph's ``__cat_dim__``.

    PyG calls ``batch.stores_as(first_graph)`` when collating and
    ``graph.stores_as(batch)`` when separating: the cat dims carry over, but a
    per-graph increment does not describe a batch, nor one graph of it.
    """
    rules = source.__dict__.get(RULES_ATTR)
    if not rules or RULES_ATTR in target.__dict__:
        return
    if isinstance(target, batch_cls) or isinstance(source, batch_cls):
        rules = {key: (cat_dim, UNKNOWN_RULE) for key, (cat_dim, _) in rules.items()}
    target.__dict__[RULES_ATTR] = rules


def rule_classes() -> dict[str, type]:
    """The ``Data`` / ``HeteroData`` subclasses that answer stored rules (built once)."""
    if not _RULE_CLASSES:
        with _RULE_CLASSES_LOCK:
            if not _RULE_CLASSES:
                _RULE_CLASSES.update(_build_rule_classes())
    return _RULE_CLASSES


def _build_rule_classes() -> dict[str, type]:
    pyg = import_pyg("decoding 'pyg' fields")

    class StoredRulesData(pyg.Data):
        """A ``Data`` decoded from a subclass whose batching rules differ from PyG's.

        ``__cat_dim__`` and ``__inc__`` return the values the original object's
        methods returned at encode time, for the attributes whose rules differed
        from ``Data``'s defaults; every other attribute follows ``Data``. The
        stored increments are constants: a transform that changes the node count
        of such a graph does not update them. A batch of such graphs keeps the
        first graph's cat dims (so ``to_data_list()`` works); a graph taken out of
        that batch knows its cat dims but not its custom increments, and raises
        :class:`~shardflow.errors.SampleError` if batched again.
        """

        def __cat_dim__(self, key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            cat_dim = _stored_cat_dim(self, key, None)
            if cat_dim != DEFAULT_RULE:
                return cat_dim
            return super().__cat_dim__(key, value, *args, **kwargs)

        def __inc__(self, key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            inc = _stored_inc(self, key, None)
            if not isinstance(inc, str):
                return inc
            return super().__inc__(key, value, *args, **kwargs)

        def stores_as(self, data: Any) -> Any:
            _inherit_rules(self, data, pyg.Batch)
            return super().stores_as(data)

    class StoredRulesHeteroData(pyg.HeteroData):
        """A ``HeteroData`` decoded from a subclass whose batching rules differ.

        Rules are looked up by (node or edge type, attribute name); see
        :class:`StoredRulesData`.
        """

        def __cat_dim__(
            self, key: str, value: Any, store: Any = None, *args: Any, **kwargs: Any
        ) -> Any:
            cat_dim = _stored_cat_dim(self, key, store)
            if cat_dim != DEFAULT_RULE:
                return cat_dim
            return super().__cat_dim__(key, value, store, *args, **kwargs)

        def __inc__(
            self, key: str, value: Any, store: Any = None, *args: Any, **kwargs: Any
        ) -> Any:
            inc = _stored_inc(self, key, store)
            if not isinstance(inc, str):
                return inc
            return super().__inc__(key, value, store, *args, **kwargs)

        def stores_as(self, data: Any) -> Any:
            _inherit_rules(self, data, pyg.Batch)
            return super().stores_as(data)

    for cls in (StoredRulesData, StoredRulesHeteroData):
        cls.__module__ = "shardflow.graph.codec"  # where pickle finds them
        cls.__qualname__ = cls.__name__
    return {cls.__name__: cls for cls in (StoredRulesData, StoredRulesHeteroData)}


def stored_rules(graph: Any) -> dict | None:
    """The stored batching rules of a decoded graph, or None for PyG's defaults.

    Returns:
        A dict ``{(store_key, attribute): (cat_dim, inc)}`` (``store_key`` is None
        for ``Data`` and for the global store of ``HeteroData``), or None.
    """
    return graph.__dict__.get(RULES_ATTR)
