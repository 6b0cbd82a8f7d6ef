"""Checkpoint converters: HF gpt_bigcode <-> Megatron (megatron-core, Megatron-LM legacy, BigCode fork).

`convert()` lives in conversion.py; it is imported on first use so that the command line
(`python -m converters --help`) answers without importing torch.
"""

_LAZY = ("convert", "verify", "format_module", "ConversionError")
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        from converters import conversion

        return getattr(conversion, name)
    raise AttributeError(f"module 'converters' has no attribute {name!r}")
