"""megatron-core GPTModel adapter for gpt_bigcode (MQA / MHA): CPU or CUDA, TP over torch.distributed."""

import warnings

# megatron-core warns at import about every optional CUDA extension it does not find.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|transformer_engine).*", category=UserWarning)

from plugins.megatron.backend import MegatronGPT  # noqa: E402
from plugins.megatron.model import build_model, check_config, init_parallel, transformer_config  # noqa: E402

__all__ = ["MegatronGPT", "build_model", "check_config", "init_parallel", "transformer_config"]
