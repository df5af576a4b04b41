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


def float32_trainables(model, names: set[str], dtype: torch.dtype) -> None:
    """Make the parameters ``names`` float32 masters seen by their modules in ``dtype``."""
    from torch.nn.utils import parametrize

    from ..layers import GDNAttention

    for name in sorted(names):
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        p = getattr(mod, attr)
        setattr(mod, attr, torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad))
        if not (isinstance(mod, GDNAttention) and attr == "rho"):
            parametrize.register_parametrization(mod, attr, _CastTo(dtype), unsafe=True)


def remove_casts(model) -> None:
    """Undo :func:`float32_trainables` before saving: parameters back in the model's dtype."""
    from torch.nn.utils import parametrize

    for mod in list(model.modules()):
        if parametrize.is_parametrized(mod):
            for attr in list(mod.parametrizations):
                value = getattr(mod, attr).detach().clone()  # the float32 original, cast
                parametrize.remove_parametrizations(mod, attr, leave_parametrized=False)
                setattr(mod, attr, torch.nn.Parameter(value, requires_grad=False))
