"""The checkpoint formats by name (a light module: the command line lists them without importing torch)."""

FORMATS = {  # format name -> module
    "hf": "converters.hf",
    "megatron": "converters.megatron_core",  # megatron-core dist_checkpointing (torch_dist)
    "megatron-torch": "converters.megatron_torch",  # Megatron-LM --ckpt-format torch, megatron-core GPT model
    "megatron-legacy": "converters.megatron_legacy",
    "bigcode-megatron": "converters.bigcode_megatron",
}
WRITABLE = ("hf", "megatron", "megatron-torch", "megatron-legacy", "bigcode-megatron")
LAYER_SPECS = ("local", "te")  # megatron-torch's layer names: megatron-core's local spec or Transformer Engine's
