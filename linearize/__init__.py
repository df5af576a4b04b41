"""linearize: turn pretrained softmax-attention language models into Gated DeltaNet models.

    import linearize
    model = linearize.convert(teacher, to="gdn", tokenizer=tok)   # whole model, in place
    block = linearize.linearize_layer(teacher.model.layers[3].self_attn)  # one module
    linearize.save(model, tok, "out-dir"); model = linearize.load("out-dir")

``import linearize`` is cheap: it imports neither torch nor transformers (the CLI's ``--help``
depends on it). The API (``convert``, ``linearize_layer``, ``save``, ``load``) is loaded on first
access, from :mod:`linearize.conversion` and :mod:`linearize.saving`.

Converted models are saved with ``model_type = "linearize_<family>"``. For
``AutoModelForCausalLM.from_pretrained(dir)`` to know that type, linearize's classes must be
registered with transformers' Auto classes. That happens: on the first access of any API name
above; inside ``linearize.load``; at ``import linearize`` if transformers is already imported then;
and whenever you call ``linearize.register()`` (idempotent; call it before ``from_pretrained`` if
transformers was imported after linearize and no API name was used yet).
"""

import sys

__version__ = "0.1.0"

_API = {"convert": "conversion", "linearize_layer": "conversion", "save": "saving", "load": "saving"}


def register() -> None:
    """Register the converted families' classes with transformers' Auto classes (idempotent)."""
    from .conversion import register as _register

    _register()


def __getattr__(name):
    if name in _API:
        import importlib

        value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
        register()
        globals()[name] = value  # later accesses skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])


if "transformers" in sys.modules:
    register()

__all__ = ["__version__", "convert", "linearize_layer", "load", "register", "save"]
