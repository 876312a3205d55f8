"""torch.distributed.checkpoint's get_optimizer_state_dict writes NaN into fp16 parameters when
the optimizer has not stepped yet.

Found by the matrix's accelerate-fsdp2 engine (cell tiny-transformer-fp16-true-eval-cpu-
accelerate-fsdp2): accelerate's save_state asks DCP for the optimizer's state dict; an AdamW
that never stepped has no state, so DCP's _init_optim_state gives every parameter a zero
gradient and runs optimizer.step() with the learning rate set to 0. In fp16, AdamW's eps=1e-8
rounds to 0, the step's update is 0 * (0 / 0) = NaN, and the parameters become NaN. Related:
pytorch/pytorch#164929 (get_optimizer_state_dict modifies optimizer state).

Single process, no process group needed. Exit 1 = reproduced.
"""

import sys

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

reproduced = False
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    get_optimizer_state_dict(model, optimizer)
    finite = bool(torch.isfinite(model.weight).all())
    print(f"torch {torch.__version__} {dtype}: parameters finite after get_optimizer_state_dict: {finite}")
    reproduced |= not finite
print("REPRODUCED" if reproduced else "NOT REPRODUCED")
sys.exit(1 if reproduced else 0)
