set -u
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .carry/w/*.whl >/dev/null 2>&1
timeout 90 python - <<'PY' 2>&1 | grep -v -i warn
import copy, sys, torch
sys.path.insert(0, "scripts")
from bench_distill import SMOLLM2
from transformers import LlamaConfig, LlamaForCausalLM
import linearize
from linearize.config import RecipeConfig
from linearize.distill.trainer import Run, align_loss, gdn_layers
from pathlib import Path
torch.manual_seed(0)
cfg = LlamaConfig(**SMOLLM2); cfg._attn_implementation = "sdpa"
t = LlamaForCausalLM(cfg).cuda().bfloat16().eval().requires_grad_(False)
s = linearize.convert(copy.deepcopy(t), calibration_ids=torch.randint(0, 49152, (1, 512), device="cuda"))
for a in gdn_layers(s).values():
    a.rho.requires_grad_(True); a.gate_proj.weight.data.normal_(0, 0.02)
run = Run(RecipeConfig(), Path("."), torch.device("cuda"), torch.bfloat16, t, s, None, None)
ids = torch.randint(0, 49152, (4, 2048), device="cuda")
for name, pos in (("rows", torch.arange(2048, device="cuda").expand(4, 2048)), ("packed", (torch.arange(2048, device="cuda") % 512).expand(4, 2048))):
    res = {}
    for b in (True, False):
        loss, per = align_loss(run, ids, pos, "nmse", batched=b)
        g = torch.autograd.grad(loss, [a.rho for a in gdn_layers(s).values()])
        res[b] = (loss.float(), torch.stack(list(per.values())).float(), torch.cat(g).float())
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    print(f"GPU bf16 {name}: batched vs layer by layer rel diff: loss {rel(res[True][0], res[False][0]):.2e} per-layer {rel(res[True][1], res[False][1]):.2e} drho {rel(res[True][2], res[False][2]):.2e}")
PY
mkdir -p $OUT/rows $OUT/packed
scripts/gpu_ab.sh 100 $OUT/rows bench_distill.py --iters 9 2>&1 | grep -E "==|capture_s|vs_teacher|host_s"
scripts/gpu_ab.sh 100 $OUT/packed bench_distill.py --iters 9 --doc-len 512 2>&1 | grep -E "==|capture_s|vs_teacher|host_s"
