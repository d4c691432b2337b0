"""Run by test_loop.py under torchrun: `ddp_worker.py` (same arguments) with the model sharded by FSDP2, set up as
`accelerate launch --config_file configs/accelerate/fsdp.yaml` sets it up.

Accelerate selects FSDP only for GPU-type runs (`AcceleratorState` turns `ACCELERATE_USE_FSDP` / `fsdp_plugin`
into `DistributedType.FSDP` for MULTI_GPU, MULTI_NPU, ... but not MULTI_CPU, and silently falls back to DDP). On
CPU this worker therefore sets the distributed type itself; everything after that (`prepare` running
`fully_shard` over gloo, the gathered state dicts) is Accelerate's and torch's own code.
"""

import runpy
from pathlib import Path

from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType
from test_accelerate_configs import CONFIGS, fsdp_plugin_from, launch_env

from hf_latentlm.training import loop

FSDP_CONFIG = next(path for path in CONFIGS if path.name == "fsdp.yaml")


class FSDPOnCPU(Accelerator):
    def __init__(self, *args, **kwargs):
        plugin = fsdp_plugin_from(launch_env(FSDP_CONFIG)[1])
        super().__init__(*args, fsdp_plugin=plugin, **kwargs)
        # Both singletons: a later `AcceleratorState()` copies PartialState's fields over its own.
        PartialState().distributed_type = self.state.distributed_type = DistributedType.FSDP
        self.state.fsdp_plugin = plugin


loop.Accelerator = FSDPOnCPU
runpy.run_path(str(Path(__file__).with_name("ddp_worker.py")), run_name="__main__")
