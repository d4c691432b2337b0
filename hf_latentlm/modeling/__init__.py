"""Model families. Importing this package registers each family with the transformers Auto classes,
so `AutoConfig` / `AutoModel` / `AutoModelForCausalLM` resolve them in-process; saved checkpoints
also carry the flat modeling files and a full `auto_map` for `trust_remote_code` elsewhere."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_plm import PLMConfig
from .modeling_plm import PLMForCausalLM

AutoConfig.register("plm", PLMConfig, exist_ok=True)
AutoModel.register(PLMConfig, PLMForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(PLMConfig, PLMForCausalLM, exist_ok=True)
PLMConfig.register_for_auto_class()
PLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["PLMConfig", "PLMForCausalLM"]
