"""A matplotlib figure as inline SVG for the offline HTML pages (no file, no network)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # files only: runs on machines without a display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure


def figure_svg(figure: Figure) -> str:
    """The figure's `<svg>` element (without the XML prolog and doctype); closes the figure."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    plt.close(figure)
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]
