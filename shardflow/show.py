"""Contact sheets of a dataset: a grid of images, or of graphs, with their labels and keys.

:func:`render_grid` picks samples (evenly spread over the dataset when the
manifest gives counts, else the first ones), finds the image or graph field,
and returns a ``PIL.Image``:

- images: each tile is the image fitted into ``tile`` x ``tile`` pixels
  (scaled up or down, aspect kept, centred on a white cell), with a caption strip of
  :data:`CAPTION_HEIGHT` pixels under it holding the label (and its class name
  from ``meta["class_to_idx"]``) and the key. The grid is
  ``cols * tile`` wide and ``rows * (tile + CAPTION_HEIGHT)`` high, with
  ``rows = ceil(count / cols)`` and ``cols = min(cols, count)``.
- graphs (``pyg`` fields): a node-link drawing per graph (networkx spring
  layout, seeded, so the same graph is drawn the same way), titled with key,
  node and edge counts and label; node colour marks the node type of a
  ``HeteroData``. The grid is ``cols * tile`` by ``rows * tile`` pixels. Needs
  matplotlib and networkx (the ``show`` extra).
"""

from __future__ import annotations

import io as _io
import math
import os
from collections.abc import Sequence
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from . import storage
from .codecs import IMAGE_FIELD, DecodeOptions, decode_field, field_alternatives, is_image_field
from .errors import MissingFieldError, missing_dependency
from .format.keys import codec_extension
from .inspect import class_names, head
from .sources.source import resolve_source

__all__ = ["CAPTION_HEIGHT", "render_grid", "save_grid"]

CAPTION_HEIGHT = 32
"""Pixels of caption (two text lines) under each image tile."""

BACKGROUND = (255, 255, 255)
_MAX_DRAWN_NODES = 300  # larger graphs are drawn as the subgraph on their first nodes
_FONT_SIZE = 11


def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=_FONT_SIZE)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


def _pick_field(samples: Sequence[dict[str, Any]], field: str | None) -> str:
    names: list[str] = []
    for s in samples:
        names.extend(k for k in s if not k.startswith("__") and k not in names)
    if field is not None:
        if not any(alt in s for s in samples for alt in field_alternatives(field)):
            raise MissingFieldError(f"no sample shown has the field {field!r}; the fields are {sorted(names)}")
        return field
    images = [name for name in names if is_image_field(name)]
    if images:  # one image field, or the alias for a folder of .jpg and .png files
        return images[0] if len(images) == 1 else IMAGE_FIELD
    for name in names:
        if codec_extension(name) == "pyg":
            return name
    raise MissingFieldError(
        f"no image or graph field to show; the fields are {sorted(names)} (choose one with field=)"
    )


def _label_text(sample: dict[str, Any], label: str | None, names: dict[Any, str]) -> str:
    if not label or label not in sample:
        return ""
    raw = sample[label]
    try:
        value: Any = decode_field(label, raw, DecodeOptions(image=None))
    except Exception:  # a label that does not decode is still worth showing as text
        value = raw
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace").strip()
    name = names.get(value) if isinstance(value, int) else None
    return f"{name} ({label} {value})" if name else f"{label} {value}"


def _fit(text: str, font: Any, width: int, draw: ImageDraw.ImageDraw) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength("…" + text, font=font) > width:
        text = text[1:]
    return "…" + text  # keep the end: the distinctive part of a key


def _image_grid(samples: list[dict[str, Any]], field: str, label: str | None, names: dict[Any, str],
                cols: int, tile: int) -> Image.Image:
    rows = math.ceil(len(samples) / cols)
    cell_h = tile + CAPTION_HEIGHT
    grid = Image.new("RGB", (cols * tile, rows * cell_h), BACKGROUND)
    draw = ImageDraw.Draw(grid)
    font = _font()
    line = CAPTION_HEIGHT // 2
    options = DecodeOptions(image="pil")
    for i, s in enumerate(samples):
        x, y = (i % cols) * tile, (i // cols) * cell_h
        inner = tile - 4
        # "image" (or "jpg;png") stands for whichever image field the sample has
        name = next((alt for alt in field_alternatives(field) if alt in s), field)
        try:
            img = decode_field(name, s[name], options) if name in s else None
        except Exception as e:  # show what is wrong instead of failing the whole sheet
            img = None
            draw.text((x + 4, y + tile // 2), _fit(f"undecodable: {e}", font, inner, draw), fill=(200, 0, 0), font=font)
        if img is not None:
            scale = min(inner / img.width, inner / img.height)
            size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
            img = img.resize(size, Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC)
            grid.paste(img, (x + (tile - img.width) // 2, y + (tile - img.height) // 2))
        elif name not in s:
            draw.text((x + 4, y + tile // 2), f"no field {field!r}", fill=(200, 0, 0), font=font)
        text = _label_text(s, label, names)
        draw.text((x + 3, y + tile + 2), _fit(text, font, tile - 6, draw), fill=(0, 0, 0), font=font)
        draw.text((x + 3, y + tile + 2 + line), _fit(s["__key__"], font, tile - 6, draw), fill=(90, 90, 90), font=font)
    return grid


def _graph_grid(samples: list[dict[str, Any]], field: str, label: str | None, names: dict[Any, str],
                cols: int, tile: int) -> Image.Image:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # no pyplot: no global backend
    except ImportError as e:
        raise missing_dependency("matplotlib", "show", "drawing graphs") from e
    try:
        import networkx as nx
    except ImportError as e:
        raise missing_dependency("networkx", "show", "drawing graphs") from e
    from .graph import decode_graph

    rows = math.ceil(len(samples) / cols)
    dpi = 100
    fig = Figure(figsize=(cols * tile / dpi, rows * tile / dpi), dpi=dpi)
    renderer = FigureCanvasAgg(fig).get_renderer()
    cell_w, cell_h = 1 / cols, 1 / rows
    title_h = 26 / (rows * tile)  # two 7-point lines
    pad_x, pad_y = 3 / (cols * tile), 3 / (rows * tile)
    palette = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb"]
    for i, s in enumerate(samples):
        x0, top = (i % cols) * cell_w, 1 - (i // cols) * cell_h
        ax = fig.add_axes((x0 + pad_x, top - cell_h + pad_y, cell_w - 2 * pad_x, cell_h - title_h - 2 * pad_y))
        ax.set_axis_off()
        graph = decode_graph(s[field])
        hetero = type(graph).__name__ == "HeteroData"
        text = _label_text(s, label, names)
        y = None if hetero else getattr(graph, "y", None)
        if not text and y is not None and hasattr(y, "numel") and y.numel() == 1:
            text = f"y {y.item():g}" if y.is_floating_point() else f"y {int(y.item())}"
        title = [s["__key__"], f"{graph.num_nodes or 0} nodes · {graph.num_edges} edges" + (f" · {text}" if text else "")]
        if hetero:
            homo = graph.to_homogeneous(add_node_type=True, add_edge_type=False)
            node_type: list[int] | None = homo.node_type.tolist()
            edge_index = homo.edge_index
            n = int(homo.num_nodes or 0)
        else:
            node_type = None
            edge_index = getattr(graph, "edge_index", None)
            n = int(graph.num_nodes or 0)
        shown = min(n, _MAX_DRAWN_NODES)
        g = nx.Graph()
        g.add_nodes_from(range(shown))
        if edge_index is not None and edge_index.numel():
            g.add_edges_from((a, b) for a, b in edge_index.t().tolist() if a < shown and b < shown and a != b)
        if shown < n:
            title[-1] += f" (first {shown} drawn)"
        colors: Any = palette[0]
        if node_type is not None:
            colors = [palette[t % len(palette)] for t in node_type[:shown]]
            for t, name in enumerate(graph.node_types):
                ax.scatter([], [], s=8, color=palette[t % len(palette)], label=name)
            ax.legend(loc="lower left", fontsize=6, frameon=False, handletextpad=0.1, borderaxespad=0)
        pos = nx.spring_layout(g, seed=0) if shown else {}
        size = max(4.0, 60.0 / math.sqrt(max(shown, 1)))
        nx.draw_networkx_edges(g, pos, ax=ax, width=0.6, edge_color="#888888")
        nx.draw_networkx_nodes(g, pos, ax=ax, node_size=size, node_color=colors, linewidths=0)
        ax.set_axis_off()
        label_text = fig.text(x0 + cell_w / 2, top - pad_y, "\n".join(title), ha="center", va="top", fontsize=7)
        while label_text.get_fontsize() > 4 and label_text.get_window_extent(renderer).width > tile - 4:
            label_text.set_fontsize(label_text.get_fontsize() - 0.5)  # keep the title inside its tile
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    buf.seek(0)
    out = Image.open(buf)
    out.load()
    return out.convert("RGB")


def render_grid(
    source: str | os.PathLike | Sequence[str],
    *,
    n: int = 16,
    cols: int = 4,
    field: str | None = None,
    label: str | None = "cls",
    tile: int = 160,
    spread: bool = True,
    io: storage.IOOptions | None = None,
) -> Image.Image:
    """Draw ``n`` samples of a dataset as a grid.

    Args:
        source: anything :class:`~shardflow.ShardDataset` accepts.
        n: samples to show (fewer if the dataset is smaller).
        cols: tiles per row.
        field: the image or ``pyg`` field to draw; ``"image"`` stands for
            whichever image field each sample has. Default: the image field, or
            ``"image"`` when samples have several (a folder of JPEGs and PNGs),
            else the first graph field.
        label: field shown as the label (its class name added from
            ``meta["class_to_idx"]``); None for none.
        tile: tile size in pixels (square).
        spread: take samples evenly spaced over the dataset (needs a manifest),
            not just the first ``n``.
        io: storage options.

    Returns:
        An RGB ``PIL.Image``; see the module docstring for its exact size.

    Raises:
        MissingFieldError: ``field`` is absent, or there is no image or graph field.
        ValueError: ``n``, ``cols`` or ``tile`` is not positive.
        ImportError: graphs without matplotlib or networkx installed.
    """
    if n < 1 or cols < 1 or tile < 16:
        raise ValueError(f"n and cols must be >= 1 and tile >= 16, got n={n}, cols={cols}, tile={tile}")
    io = io or storage.IOOptions()
    src = resolve_source(source, io)
    samples = head(src, n, spread=spread, io=io)
    if not samples:
        raise ValueError(f"{source}: the dataset has no samples to show")
    name = _pick_field(samples, field)
    names = class_names(src.manifest.meta) if src.manifest is not None else {}
    cols = min(cols, len(samples))
    if codec_extension(name) == "pyg":
        return _graph_grid(samples, name, label, names, cols, tile)
    return _image_grid(samples, name, label, names, cols, tile)


def save_grid(path: str | os.PathLike, source: str | os.PathLike | Sequence[str], **kwargs: Any) -> Image.Image:
    """:func:`render_grid`, saved as a PNG at ``path`` (a local path); returns the image."""
    grid = render_grid(source, **kwargs)
    grid.save(os.fspath(path), format="PNG")
    return grid
