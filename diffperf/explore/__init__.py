"""Which plan: grids, the sweep engine, plan search for training and serving, what-if hardware."""

from ._grid import Grid as Grid
from ._search_inference import search_inference as search_inference
from ._search_training import (
    default_training_grid as default_training_grid,
    even_layout as even_layout,
    plan_from_values as plan_from_values,
    search_training as search_training,
)
from ._sweep import (
    SweepResult as SweepResult,
    evaluate_all as evaluate_all,
    pareto_front as pareto_front,
    run_sweep as run_sweep,
)
from ._what_if import (
    Override as Override,
    apply_overrides as apply_overrides,
    parse_overrides as parse_overrides,
)
