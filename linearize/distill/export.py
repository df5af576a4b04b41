"""The trained student saved in the ``convert`` format: float32 masters cast back, LoRA merged, FSDP
shards gathered; the loss plot and a summary beside it."""

from __future__ import annotations

import json
from pathlib import Path

from .lora import merge_lora
from .metrics import plot_losses
from .parallel import is_main
from .precision import remove_casts


def save_student(run, final_eval: dict, initial_eval: dict | None) -> Path:
    """Every process calls this under FSDP (gathering is a collective); rank 0 writes."""
    from safetensors.torch import save_file

    from ..saving import save

    model = run.student
    if run.fsdp:  # gather the whole model (every process), save it from rank 0's unsharded copy
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(run.student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not is_main():
            return run.out / "model"
        run.skeleton.load_state_dict(whole)
        model = run.skeleton
    remove_casts(model)
    adapter = merge_lora(model)

    def extra(folder: Path):
        (folder / "distill_summary.json").write_text(json.dumps({"initial": initial_eval, "final": final_eval}, indent=1))
        if adapter is not None and run.cfg.output.keep_adapter:
            save_file({k: v.contiguous() for k, v in adapter.items()}, folder / "lora_adapter.safetensors")

    model_dir = save(model, run.tokenizer, run.out / "model", force=True, extra=extra)
    plot_losses(run.out)
    return model_dir
