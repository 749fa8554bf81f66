"""The software runtime of a training job: how much host (CPU) time it spends issuing the work.

The host issues kernels and collectives asynchronously. While the GPU's work per operator is
long, the GPU never waits; when it is short (small models, high tensor parallelism, small
micro-batches), the GPU waits for the host, and a layer takes about the longer of the two
streams (`diffperf.training.host_wait`). An eager framework spends microseconds to tens of
microseconds of CPU per operator (Python, the dispatcher, autograd recording, the launch
itself); a CUDA graph replays a whole captured step for a few microseconds in all.
"""

from __future__ import annotations

import equinox as eqx
import jax

from .._checks import check_fraction, check_nonnegative, names_number_fields, number_field as _F


@names_number_fields
class Runtime(eqx.Module):
    """Host-side costs of the software stack that runs a training step. Every field is a
    differentiable leaf (vmap / grad over runtimes works as over hardware).

    **Arguments:**

    - `host_op_time`: host time to issue one framework-level operator of the forward pass
      (Python, dispatcher, autograd recording, kernel launch), s.
    - `host_backward_op_time`: host time of one operator the autograd engine runs in the
      backward pass, s.
    - `host_collective_time`: host time to issue one collective (process group call, NCCL
      enqueue), s.
    - `ops_per_layer`: framework operators issued by one transformer layer's forward pass
      (including views and reshapes, which cost host time but launch no kernel), count.
    - `backward_ops_per_op`: backward operators per forward operator, ratio.
    - `cuda_graph`: 1 if the training step is captured in a CUDA graph (its replay costs the
      host nothing per operator), 0 for eager execution.

    The default (every host time 0) is the runtime of the calibration set (Megatron-Core /
    NeMo on large models): its host never binds, and predictions are those of the model
    without a host stream. Named presets: `diffperf.presets.runtime`.
    """

    host_op_time: jax.Array = _F(default=0.0)
    host_backward_op_time: jax.Array = _F(default=0.0)
    host_collective_time: jax.Array = _F(default=0.0)
    ops_per_layer: jax.Array = _F(default=40.0)
    backward_ops_per_op: jax.Array = _F(default=1.0)
    cuda_graph: jax.Array = _F(default=0.0)

    def __check_init__(self):
        for name in ("host_op_time", "host_backward_op_time", "host_collective_time",
                     "ops_per_layer", "backward_ops_per_op"):
            check_nonnegative("Runtime", name, getattr(self, name))
        check_fraction("Runtime", "cuda_graph", self.cuda_graph)
