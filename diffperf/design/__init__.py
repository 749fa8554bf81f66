"""Which hardware: the technology generator (12 nm -> 1 nm), node studies, the A100 -> B200
speed-up attribution, sensitivity and bottlenecks, and accelerator co-design under budgets."""

from ._attribution import attribute as attribute, attribute_inference as attribute_inference
from ._codesign import (
    Budgets as Budgets,
    default_problem as default_problem,
    grid_search as grid_search,
    optimise as optimise,
)
from ._node_study import node_study as node_study
from ._sensitivity import (
    bottlenecks as bottlenecks,
    hardware_elasticities as hardware_elasticities,
    technology_elasticities as technology_elasticities,
)
from ._technology import (
    Design as Design,
    generate as generate,
    reference_point as reference_point,
)
