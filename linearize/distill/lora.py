"""LoRA adapters through peft: injected before training, merged into plain ``nn.Linear`` at save."""

from __future__ import annotations


def add_lora(model, cfg) -> bool:
    """Inject peft LoRA layers (largest rank any stage asks for) in place; names keep their paths."""
    stages = [st for st in cfg.stages if st.lora_rank > 0]
    if not stages:
        return False
    from peft import LoraConfig, inject_adapter_in_model

    rank = max(st.lora_rank for st in stages)
    targets = sorted({t.strip() for st in stages for t in st.lora_targets.split(",") if t.strip()})
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets), model)
    return True


def merge_lora(model) -> dict | None:
    """Fold every LoRA layer into its base ``nn.Linear`` and put the plain layer back; returns the adapter."""
    from peft.tuners.lora import LoraLayer

    adapter = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if "lora_" in n}
    if not adapter:
        return None
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    from ..decoding import drop_decode_caches

    drop_decode_caches(model)  # the merge writes through .data: what decoding copied from the weights is stale
    return adapter
