"""Fused kernels that are not the GDN operator: the distillation loss (:mod:`.kl`), the align stage's
row sums (:mod:`.rowsq`), RoPE (:mod:`.rope`) and RMSNorm for inference (:mod:`.norm`). Each module holds
its Triton kernel, its host launcher and its public function; import them by module (they import Triton)."""
