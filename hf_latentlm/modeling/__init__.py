"""Model families. Importing this package registers each family with the transformers Auto classes,
so `AutoConfig` / `AutoModel` / `AutoModelForCausalLM` resolve them in-process; saved checkpoints
also carry the flat modeling files and a full `auto_map` for `trust_remote_code` elsewhere."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_aurora import AuroraAutoencoderConfig, AuroraConfig
from .configuration_calm import CALMAutoencoderConfig, CALMConfig
from .configuration_cola import ColaConfig, ColaVAEConfig
from .configuration_plm import PLMConfig
from .modeling_aurora import AuroraAutoencoder, AuroraForCausalLM
from .modeling_calm import CALMAutoencoder, CALMForCausalLM
from .modeling_cola import ColaForCausalLM, ColaTextVAE
from .modeling_plm import PLMForCausalLM


def register_auto_classes(config_class, model_class, language_model: bool = True) -> None:
    """Make `config_class.model_type` resolve to `model_class` through the Auto classes in this process, and record
    the Auto class in saved configs. `AutoModel` gives the backbone (`model_class.base_model_class`) where there is
    one, as for transformers' own models. Components (not language models) get `AutoModel` only."""
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, getattr(model_class, "base_model_class", None) or model_class, exist_ok=True)
    config_class.register_for_auto_class()
    if language_model:
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        model_class.register_for_auto_class("AutoModelForCausalLM")
    else:
        model_class.register_for_auto_class("AutoModel")


register_auto_classes(PLMConfig, PLMForCausalLM)
register_auto_classes(CALMConfig, CALMForCausalLM)
register_auto_classes(CALMAutoencoderConfig, CALMAutoencoder, language_model=False)
register_auto_classes(ColaConfig, ColaForCausalLM)
register_auto_classes(ColaVAEConfig, ColaTextVAE, language_model=False)
register_auto_classes(AuroraConfig, AuroraForCausalLM)
register_auto_classes(AuroraAutoencoderConfig, AuroraAutoencoder, language_model=False)

__all__ = ["AuroraAutoencoder", "AuroraAutoencoderConfig", "AuroraConfig", "AuroraForCausalLM", "PLMConfig", "PLMForCausalLM", "CALMAutoencoderConfig", "CALMAutoencoder", "CALMConfig",
           "CALMForCausalLM", "ColaConfig", "ColaForCausalLM", "ColaTextVAE", "ColaVAEConfig", "register_auto_classes"]
