"""Will a config fit? Compile every program a run puts on each device (the train step; the
generator's decode chunk, admission or prefill, and held-out evaluation) from abstract shapes
and read XLA's memory analysis, per device, before anything is allocated.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        jaxrl-scale memory --config configs/scalerl_qwen3-8b_math.yaml --device-memory 80

Nothing here touches real weights or data: the model, optimizer state and batches are
ShapeDtypeStructs carrying the shardings the run would give them, so a laptop with fake CPU
devices plans a pod's run. The numbers are what XLA's compiler reserves for one device on the
platform it compiled for (the CPU compiler's buffer assignment when run on fake devices: the
same shapes and shardings as on an accelerator, though fusion and scheduling differ, so treat
a margin of 10-15% as noise). Under `model.attention: auto` the CPU compiles the blockwise
attention where a GPU runs cuDNN and a TPU the splash kernel; the report names the program
it compiled, and only a plan run on the accelerator compiles the accelerator's own. Likewise
a mixture of experts' grouped matmul (ragged_dot, which the CPU lowers to dense matmuls over
masked copies) is planned on CPUs by `moe.experts_scan`, the same buffers one tile at a time.

A verdict compares what one device holds at once with the memory pool JAX gets there: on a
GPU, XLA_PYTHON_CLIENT_MEM_FRACTION of the device (JAX preallocates 0.75 unless it is set;
the launchers set it), on a TPU the whole device (`--mem-fraction 1`).

On CPU a bf16 program's temporaries hold float32 copies of every bf16 matmul operand (the CPU
has no bf16 matmuls; for a decode chunk that is every layer's weights and the whole KV cache,
at twice their bytes: measured, 1.78 GiB per Qwen3-8B layer at 64 slots x 17k tokens). An
accelerator makes no such copies, so for a bf16 config the CPU also compiles the float32
program (no copies, activations twice as wide) and reports the smaller of the two
temporaries, each an upper bound; both stay in the report.

With LoRA (`model.lora.rank` > 0) the plan holds what such a run holds (lora.py): the train
step's arguments are the frozen base (in `model.lora.base_dtype`, never donated) beside a
train state of the adapters alone, whose gradients and optimizer moments are the adapters';
the generator keeps one copy of the base in its decoding dtypes and receives only adapters,
so its copies in flight are adapter copies. The report adds what full fine-tuning of the
same model would hold per device (parameters, gradients and Adam's moments in float32, from
the same shapes and layout) beside LoRA's.
"""

from jaxrl_scale.memory.abstract import default_mem_fraction, resolve_model
from jaxrl_scale.memory.plan import plan
from jaxrl_scale.memory.report import format_plan

__all__ = ["default_mem_fraction", "format_plan", "plan", "resolve_model"]
