"""One optimizer step of distributed training: time by term, memory, FLOPs, MFU / HFU."""

from ._detail import (
    CommTerm as CommTerm,
    TrainingDetail as TrainingDetail,
    training_detail as training_detail,
)
from ._flops import (
    hardware_flops_per_step as hardware_flops_per_step,
    model_flops_per_step as model_flops_per_step,
)
from ._memory import (
    TrainingMemory as TrainingMemory,
    activation_bytes_per_layer as activation_bytes_per_layer,
    in_flight_factor as in_flight_factor,
    params_per_gpu as params_per_gpu,
    sharded_params_per_gpu as sharded_params_per_gpu,
    training_memory as training_memory,
)
from ._notes import training_notes as training_notes, utilisation_notes as utilisation_notes
from ._step import (
    TrainingReport as TrainingReport,
    predict_training as predict_training,
    train_step as train_step,
)
