"""DeepSpeed-Inference kernel injection for HF gpt_bigcode (SantaCoder / StarCoder), MQA and MHA, and for
HF starcoder2 (StarCoder2: GQA, RoPE, sliding window; injection/starcoder2.py).

    import deepspeed, injection
    injection.register()
    engine = deepspeed.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True)
    out = engine.module.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False)

Everything DeepSpeed-specific lives here; nothing outside this package imports DeepSpeed internals.
"""

from plugins.engine.kv_cache import SingleHeadCache, SingleHeadLayer


def register():
    """Plug the gpt_bigcode and starcoder2 policies into DeepSpeed's kernel injection; idempotent. Returns
    the gpt_bigcode policy class."""
    from injection import compat
    from injection.policy import GPTBigCodeContainer, GPTBigCodePolicy
    from injection.starcoder2 import Starcoder2Container, Starcoder2Policy

    compat.apply(Starcoder2Policy, Starcoder2Container)
    compat.apply(GPTBigCodePolicy, GPTBigCodeContainer)
    return GPTBigCodePolicy


__all__ = ["register", "SingleHeadCache", "SingleHeadLayer"]
