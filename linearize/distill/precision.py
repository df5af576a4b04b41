"""Mixed precision with float32 master weights in a bf16 model.

An AdamW step of lr ~1e-4 is below bf16's resolution of a weight ~0.03 (and of ρ ≈ 1), so bf16
parameters would lose most updates: every trainable parameter is kept in float32 and modules see it
cast to the compute dtype on each use (``torch.nn.utils.parametrize``; the names gain
``.parametrizations.<name>.original``). ρ is used in float32 by the Taylor front anyway and is simply
kept float32.
"""

from __future__ import annotations

import torch


class _CastTo(torch.nn.Module):
    """Parametrization: the module sees its float32 parameter in the compute dtype."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _places(model) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """Every (module, attribute) holding each parameter: tied weights (embeddings and LM head) share one."""
    places: dict[int, list] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((mod, attr))
    return places


def float32_trainables(model, names: set[str], dtype: torch.dtype) -> None:
    """Make the parameters ``names`` float32 masters seen by their modules in ``dtype``; a tied parameter
    gets one master, seen through every module that holds it."""
    from torch.nn.utils import parametrize

    from ..layers import GDNAttention

    places = _places(model)
    for name in sorted(names):
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        p = getattr(mod, attr)
        if p.dtype == torch.float32 and not parametrize.is_parametrized(mod, attr):
            continue  # float32 already (ρ), or a tied parameter done under its other name
        master = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
        for holder, a in places[id(p)]:
            setattr(holder, a, master)
            if not (isinstance(holder, GDNAttention) and a == "rho"):
                parametrize.register_parametrization(holder, a, _CastTo(dtype), unsafe=True)


def remove_casts(model) -> None:
    """Undo :func:`float32_trainables` before saving: parameters back in the model's dtype, ties kept."""
    from torch.nn.utils import parametrize

    done: dict[int, torch.nn.Parameter] = {}
    for mod in list(model.modules()):
        if parametrize.is_parametrized(mod):
            # removal deletes the tensor's property from the module's class, which a deep copy shares with its
            # original: give the module a class of its own first, so a copy's removal leaves the original whole
            cls = type(mod)
            mod.__class__ = type(cls.__name__, cls.__bases__,
                                 {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")})
            for attr in list(mod.parametrizations):
                master = mod.parametrizations[attr].original
                if id(master) not in done:  # the float32 original, cast; one tensor for all its holders
                    done[id(master)] = torch.nn.Parameter(getattr(mod, attr).detach().clone(), requires_grad=False)
                parametrize.remove_parametrizations(mod, attr, leave_parametrized=False)
                setattr(mod, attr, done[id(master)])
