"""DeepSpeed ZeRO stage 0 with bf16 never zeroes the gradients between optimizer steps.

A tiny deterministic MLP (fixed seed, one fixed batch) trained for 6 steps by `deepspeed.initialize`
on the CPU (one gloo rank), bf16, gradient_accumulation_steps 1, the config's AdamW (`torch_adam`):
at ZeRO stage 0, at stage 0 with the AdamW state cleared right after initialize (stage 0*, below), at
stage 1, and by plain torch (bf16 module, fp32 masters from the bf16-cast weights, torch's AdamW).
After each backward it compares the gradients on the stage 0 module with that step's own gradient
(a plain copy of the module, same weights): the stale share is the part that is not, up to the loss
scale. Exit 1 when earlier steps' gradients are in it (the bug), 0 when not.

Upstream: deepspeedai/DeepSpeed#7837, fixed by #7839 (first released in 0.18.6). Since 0.17.6 bf16
without ZeRO wraps the optimizer in `FP16_UnfusedOptimizer`, and `DeepSpeedEngine._take_model_step`
zeroed the gradients under bf16 only when ZeRO was enabled. In 0.18.3-0.18.5 `engine.backward` also
no longer scales the loss while the wrapper still divides the gradients by its loss scale (65536),
which with AdamW's eps changes even the first update (stage 0* at step 2). Apart from #7837, the
wrapper's constructor steps AdamW once on zero gradients, so its bias correction runs one step ahead
of stage 1's: stage 0 differs from stage 1 from step 2 on even in 0.18.6; stage 0* does not.

Run: python docs/upstream-deepspeed/zero0_bf16_gradients_not_zeroed.py   (30 to 100 s on 2 cores)
Run here (torch 2.13.0+cpu, Python 3.11, one gloo rank), losses of steps 1-6:
    stage 1 and torch, every release  1.562897 1.258265 1.005603 0.787575 0.603906 0.451544
    0.17.5         OK   stage 0       equal to stage 1 (its wrapper there: BF16_Optimizer)
    0.17.6, 0.18.2 BUG  stage 0       1.562897 1.324883 1.106280 0.912955 0.748057 0.608705
    0.18.3-0.18.5  BUG  stage 0       1.562897 1.337041 1.117278 0.925073 0.759556 0.619974
    0.18.6         OK   stage 0       1.562897 1.324883 1.097750 0.884517 0.697050 0.532620
                        stage 0*      equal to stage 1
"""

import os
import socket
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed
import torch

STEPS, LR = 6, 1e-2


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x.to(torch.bfloat16)).float() - y) ** 2).mean()


def stale_share(held: list, fresh: list) -> float:
    """The share of the gradients the engine's backward left on the module that is not this step's
    own gradient (`fresh`, up to one factor, the loss scale): 0 when the previous step's are gone."""
    if any(g is None for g in held):
        return float("nan")  # ZeRO moved them into its own buffers
    h, f = torch.cat([g.float().flatten() for g in held]), torch.cat([g.float().flatten() for g in fresh])
    scale = torch.dot(h, f) / torch.dot(f, f)
    return ((h - scale * f).norm() / h.norm()).item()


def train_deepspeed(stage: int, undo_init_step: bool = False) -> tuple[list[float], list[float], list[float]]:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
    }
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if undo_init_step:  # stage 0's bf16 wrapper steps AdamW once on zero grads at construction: forget it
        engine.optimizer.optimizer.state.clear()
    shadow = make_model().to(torch.bfloat16)  # this step's own gradient, outside DeepSpeed
    x, y = batch()
    losses, stale, norms = [], [], []
    for _ in range(STEPS):
        shadow.load_state_dict(engine.module.state_dict())
        shadow.zero_grad(set_to_none=True)
        loss_of(shadow, x, y).backward()
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        stale.append(stale_share([p.grad for p in engine.module.parameters()], [p.grad for p in shadow.parameters()]))
        engine.step()
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
    return losses, stale, norms


def train_torch() -> list[float]:
    """The reference: bf16 module, fp32 master weights stepped by torch's AdamW, grads zeroed."""
    model = make_model()
    master = [p.detach().to(torch.bfloat16).float() for p in model.parameters()]  # as DeepSpeed's masters
    model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(master, lr=LR, weight_decay=0.0)
    x, y = batch()
    losses = []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        for m, p in zip(master, model.parameters(), strict=True):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters(), strict=True):
                p.copy_(m)
        losses.append(loss.item())
    return losses


def main() -> int:
    one_rank = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    for key, value in one_rank.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}")
    s0, stale0, norm0 = train_deepspeed(0)
    u0, _, _ = train_deepspeed(0, undo_init_step=True)
    s1, _, norm1 = train_deepspeed(1)
    ref = train_torch()
    print("step  stage 0   stage 0*  stage 1   torch     stage 0 stale grad share  grad norm stage 0 / 1")
    for i in range(STEPS):
        print(
            f"{i + 1:>4}  {s0[i]:.6f}  {u0[i]:.6f}  {s1[i]:.6f}  {ref[i]:.6f}  {stale0[i]:>24.4f}  "
            f"{norm0[i]:>10.4g} / {norm1[i]:.4g}"
        )
    print("(stage 0*: stage 0 with the AdamW step its bf16 wrapper takes at construction undone)")

    def differ(a):
        steps = [i + 1 for i in range(STEPS) if abs(a[i] - s1[i]) > 1e-4 * abs(s1[i])]
        return f"steps {steps}" if steps else "no step"

    stale = [i + 1 for i in range(STEPS) if stale0[i] > 1e-3]
    if stale:
        print(
            f"BUG: stage 0 bf16 keeps earlier steps' gradients in those of steps {stale}; "
            f"its losses differ from stage 1's at {differ(s0)}"
        )
        return 1
    print(
        f"OK: stage 0 bf16 steps on each step's own gradients; its losses differ from stage 1's at "
        f"{differ(s0)}, and at {differ(u0)} with the construction step undone"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
