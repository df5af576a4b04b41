"""Fused kernels that are not the GDN operator: the distillation loss (:mod:`.kl`), the align stage's
row sums (:mod:`.rowsq`), RoPE (:mod:`.rope`), and for inference RMSNorm (:mod:`.norm`) and the gated MLP's
activation (:mod:`.swiglu`), which :mod:`.patch` puts on a model's own modules. Each kernel module holds its
Triton kernel, its host launcher and its public function; import them by module (they import Triton)."""
