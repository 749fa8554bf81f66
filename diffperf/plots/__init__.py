"""Everything that needs matplotlib (the optional `plot` extra, imported when a plot is drawn)."""

from ._roofline_plot import roofline_plot as roofline_plot
from ._search_plot import front_plot as front_plot
from ._serving_plot import serving_front_plot as serving_front_plot
from ._validation_plot import validation_plot as validation_plot
