"""The checkpoint formats by name (a light module: the command line lists them without importing torch)."""

FORMATS = {  # format name -> module
    "hf": "converters.hf",
    "megatron": "converters.megatron_core",  # megatron-core dist_checkpointing (torch_dist)
    "megatron-legacy": "converters.megatron_legacy",
    "bigcode-megatron": "converters.bigcode_megatron",
}
WRITABLE = ("hf", "megatron", "megatron-legacy", "bigcode-megatron")
