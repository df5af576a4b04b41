"""linearize: turn pretrained softmax-attention language models into Gated DeltaNet models.

    import linearize
    model = linearize.convert(teacher, to="gdn", tokenizer=tok)   # whole model, in place
    block = linearize.linearize_layer(teacher.model.layers[3].self_attn)  # one module
    linearize.save(model, tok, "out-dir"); model = linearize.load("out-dir")
"""

__version__ = "0.1.0"

from .convert import convert, linearize_layer, load, save  # noqa: E402
from .models.families import register_all as _register_all  # noqa: E402

_register_all()  # AutoModelForCausalLM.from_pretrained knows converted models after `import linearize`

__all__ = ["__version__", "convert", "linearize_layer", "load", "save"]
