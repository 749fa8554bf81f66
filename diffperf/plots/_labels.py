"""Point labels that do not overlap: a greedy placement around each point (no adjustText).

Each label is tried at growing distances and in 16 directions around its point, in display
coordinates, and takes the place of least cost: any overlap with a label placed before it, a
marker or the legend, or a part outside the axes, costs far more than crossing a drawn line,
which costs more than a little more distance. A label set away from its point gets a thin
leader line. The most crowded points are placed first. Call it after the axes' scales, limits,
legend and layout are final (it measures the text in pixels), and do not re-run the layout
afterwards.
"""

from __future__ import annotations

import math

import numpy as np

#: Distances from the marker's edge to the nearest edge of its label, in points.
_RADII_PT = (2.0, 8.0, 16.0, 28.0, 42.0, 60.0, 85.0, 115.0)
#: Directions tried at each distance, starting up-right (the usual label place).
_ANGLES = [math.radians(a) for a in (45, 0, -45, 90, -90, 135, 180, -135,
                                     22.5, -22.5, 67.5, -67.5, 112.5, -112.5, 157.5, -157.5)]
#: Half the side of the square kept free around each marker, in points.
_MARKER_PT = 3.5
#: Costs: of a pixel^2 of a hard overlap (label, marker, legend, outside the axes), of a
#: pixel^2 of a crossed line, of a pixel of distance from the point.
_HARD, _LINE, _FAR = 1000.0, 1.0, 0.3


def _overlaps(box: np.ndarray, others: np.ndarray) -> float:
    """Total area (px^2) that `box` (x0, y0, x1, y1) shares with the rows of `others`."""
    if not len(others):
        return 0.0
    w = np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0])
    h = np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1])
    return float(np.sum(np.clip(w, 0, None) * np.clip(h, 0, None)))


def _squares(points: np.ndarray, half: float) -> np.ndarray:
    return np.column_stack([points[:, 0] - half, points[:, 1] - half, points[:, 0] + half,
                            points[:, 1] + half]) if len(points) else np.zeros((0, 4))


def _line_samples(ax, lines, step_px: float) -> np.ndarray:
    """Points every `step_px` pixels along the polylines `lines` ((x, y) data arrays)."""
    out = []
    for x, y in lines:
        p = ax.transData.transform(np.column_stack([np.asarray(x, float),
                                                    np.asarray(y, float)]))
        p = p[np.all(np.isfinite(p), axis=1)]
        for a, b in zip(p[:-1], p[1:]):
            n = max(int(np.hypot(*(b - a)) // step_px), 1)
            out.append(a + (b - a) * np.linspace(0, 1, n + 1)[:, None])
    return np.vstack(out) if out else np.zeros((0, 2))


def place_labels(ax, x, y, texts, fontsize: float = 6.0, avoid=(), others=None,
                 lines=()) -> list:
    """Annotate the points (`x`, `y`, data coordinates) of `ax` with `texts` so that no two
    labels overlap each other, the markers (also those of the unlabelled points `others`, a
    pair of x and y arrays) or the `avoid` artists (e.g. the legend), inside the axes where
    there is room, and cross the polylines `lines` ((x, y) pairs) as little as they can;
    returns the annotations."""
    fig = ax.figure
    fig.canvas.draw()  # final transforms and text metrics
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    xy = np.column_stack([np.asarray(x, float), np.asarray(y, float)])
    pts = ax.transData.transform(xy)
    marks = pts if others is None else np.vstack([pts, ax.transData.transform(np.column_stack(
        [np.asarray(others[0], float), np.asarray(others[1], float)]))])
    m = _MARKER_PT * px_per_pt
    hard = np.vstack([_squares(marks, m)] + [
        np.array([tuple(a.get_window_extent(renderer).extents)]) for a in avoid
        if a is not None])
    soft = _squares(_line_samples(ax, lines, 3.0), 1.0)
    frame = ax.get_window_extent(renderer)
    sizes = []
    for text in texts:
        t = ax.text(0, 0, text, fontsize=fontsize, transform=None)
        box = t.get_window_extent(renderer)
        t.remove()
        sizes.append((box.width, box.height))
    # the most crowded points first: they have the fewest free places
    near = np.linalg.norm(pts[:, None, :] - pts[None, :, :], axis=-1)
    order = np.argsort(-(near < 40 * px_per_pt).sum(axis=1), kind="stable")
    out: list = [None] * len(pts)
    for i in order:
        (px, py), (w, h) = pts[i], sizes[i]
        best, best_cost = None, math.inf
        for r in _RADII_PT:
            gap = r * px_per_pt + m
            for a in _ANGLES:
                c, s = math.cos(a), math.sin(a)
                ex, ey = px + c * gap, py + s * gap
                x0 = ex - (w if c < -0.3 else w / 2 if abs(c) <= 0.3 else 0.0)
                y0 = ey - (h if s < -0.3 else h / 2 if abs(s) <= 0.3 else 0.0)
                box = np.array([x0, y0, x0 + w, y0 + h])
                outside = ((max(frame.x0 - box[0], 0) + max(box[2] - frame.x1, 0)) * h
                           + (max(frame.y0 - box[1], 0) + max(box[3] - frame.y1, 0)) * w)
                cost = (_HARD * (_overlaps(box, hard) + outside) + _LINE * _overlaps(box, soft)
                        + _FAR * gap)
                if cost < best_cost:
                    best, best_cost = (box, r), cost
        box, r = best
        hard = np.vstack([hard, box[None, :]])
        offset = ((box[0] - px) / px_per_pt, (box[1] - py) / px_per_pt)
        leader = dict(arrowstyle="-", lw=0.4, color="0.55", shrinkA=0, shrinkB=2) \
            if r > _RADII_PT[0] else None
        out[i] = ax.annotate(texts[i], xy[i], xytext=offset, textcoords="offset points",
                             ha="left", va="bottom", fontsize=fontsize, arrowprops=leader,
                             annotation_clip=False)
    return out


def emptiest_corner(ax, x, y) -> str:
    """The legend location ("upper right", ...) of the axes quadrant with the fewest points
    (a fixed place, unlike "best", which is chosen again at each draw and ignores labels)."""
    ax.get_xlim(), ax.get_ylim()  # the view limits of the data plotted so far
    fx = ax.transAxes.inverted().transform(ax.transData.transform(
        np.column_stack([np.asarray(x, float), np.asarray(y, float)])))
    counts = {}
    for vert, hi in (("upper", True), ("lower", False)):
        for horiz, right in (("right", True), ("left", False)):
            inside = ((fx[:, 1] >= 0.5) == hi) & ((fx[:, 0] >= 0.5) == right)
            counts[f"{vert} {horiz}"] = int(inside.sum())
    return min(counts, key=lambda k: counts[k])
