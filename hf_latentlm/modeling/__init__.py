"""Model families. Importing this package registers each family with the transformers Auto classes,
so `AutoConfig` / `AutoModel` / `AutoModelForCausalLM` resolve them in-process; saved checkpoints
also carry the flat modeling files and a full `auto_map` for `trust_remote_code` elsewhere."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_calm import CALMAutoencoderConfig, CALMConfig
from .configuration_plm import PLMConfig
from .modeling_calm import CALMAutoencoder, CALMForCausalLM
from .modeling_plm import PLMForCausalLM

for _config, _model in ((PLMConfig, PLMForCausalLM), (CALMConfig, CALMForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)
    _config.register_for_auto_class()
    _model.register_for_auto_class("AutoModelForCausalLM")

# The autoencoder is not a language model: AutoModel only.
AutoConfig.register(CALMAutoencoderConfig.model_type, CALMAutoencoderConfig, exist_ok=True)
AutoModel.register(CALMAutoencoderConfig, CALMAutoencoder, exist_ok=True)
CALMAutoencoderConfig.register_for_auto_class()
CALMAutoencoder.register_for_auto_class("AutoModel")

__all__ = ["PLMConfig", "PLMForCausalLM", "CALMAutoencoderConfig", "CALMAutoencoder", "CALMConfig",
           "CALMForCausalLM"]
