"""What is modelled, with no costs: the transformer, the accelerator, network and system, the
training and inference plans, the efficiency factors, and the Hugging Face config import."""

from ._attention import Projection as Projection, projections as projections
from ._efficiency import Efficiency as Efficiency, matmul_efficiency as matmul_efficiency
from ._engine import POLICIES as POLICIES, Engine as Engine
from ._hardware import (
    BYTES_PER_ELEMENT as BYTES_PER_ELEMENT,
    INTEGER_WEIGHTS as INTEGER_WEIGHTS,
    PRECISION_CODES as PRECISION_CODES,
    PRECISIONS as PRECISIONS,
    WEIGHT_SCALE_BLOCK as WEIGHT_SCALE_BLOCK,
    Accelerator as Accelerator,
    Network as Network,
    System as System,
    precision_code as precision_code,
    weight_scale_block as weight_scale_block,
    weight_storage as weight_storage,
)
from ._hf_config import transformer_from_hf_config as transformer_from_hf_config
from ._inference_plan import InferencePlan as InferencePlan
from ._runtime import Runtime as Runtime
from ._training_plan import (
    RECOMPUTE_CODES as RECOMPUTE_CODES,
    ZERO_CODES as ZERO_CODES,
    TrainingPlan as TrainingPlan,
    layer_count_error as layer_count_error,
)
from ._transformer import Transformer as Transformer
