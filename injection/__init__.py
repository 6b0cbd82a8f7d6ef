"""DeepSpeed-Inference kernel injection for HF gpt_bigcode (SantaCoder / StarCoder), MQA and MHA.

    import deepspeed, injection
    injection.register()
    engine = deepspeed.init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True)
    out = engine.module.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False)

Everything DeepSpeed-specific lives here; nothing outside this package imports DeepSpeed internals.
"""

from plugins.engine.kv_cache import SingleHeadCache, SingleHeadLayer


def register():
    """Plug the gpt_bigcode policy into DeepSpeed's kernel injection; idempotent. Returns the policy class."""
    from injection import compat
    from injection.policy import GPTBigCodeContainer, GPTBigCodePolicy

    compat.apply(GPTBigCodePolicy, GPTBigCodeContainer)
    return GPTBigCodePolicy


__all__ = ["register", "SingleHeadCache", "SingleHeadLayer"]
