"""matplotlib for the plots of diffperf (an optional dependency: `pip install diffperf[plot]`)."""

from __future__ import annotations


def pyplot(what: str):
    """`matplotlib.pyplot` on the file-only Agg backend; ImportError saying that `what` (e.g.
    "the search plot") needs matplotlib when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"{what} needs matplotlib: pip install 'diffperf[plot]' (or pip "
                          f"install matplotlib)") from None
    return plt
