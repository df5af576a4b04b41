"""The trained student saved in the ``convert`` format: float32 masters cast back, LoRA merged, FSDP
shards gathered; the loss plot and a summary beside it."""

from __future__ import annotations

import copy
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


def stage_label(stages, index: int) -> str:
    """A stage's name, or ``<index>-<name>`` when another stage has the same name (``model-<label>/``)."""
    name = stages[index].name
    return name if sum(s.name == name for s in stages) == 1 else f"{index}-{name}"


def save_stage_model(run, stage: str, step: int, stage_eval: dict | None) -> Path:
    """The student as it is at the end of ``stage`` (``output.save_stages``), saved in the ``convert`` format
    to ``model-<stage>/`` beside the final model, with the stage's closing evaluation in ``stage_summary.json``.
    The training model is left as it is: a copy has its casts removed and its LoRA merged. Rank 0 writes."""
    from ..saving import save

    path = run.out / f"model-{stage}"
    if not is_main():
        return path
    model = copy.deepcopy(run.student)
    remove_casts(model)
    merge_lora(model)

    def extra(folder: Path):
        (folder / "stage_summary.json").write_text(json.dumps({"stage": stage, "step": step, "eval": stage_eval},
                                                              indent=1))

    save(model, run.tokenizer, path, force=True, extra=extra)
    return path
