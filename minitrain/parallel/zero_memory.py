"""The ZeRO paper's model-state memory formulas (Rajbhandari et al. 2020, sec. 5, Figure 1).

Ψ parameters, N data-parallel ranks; per parameter: param_bytes for the parameters, grad_bytes
for the gradients and K bytes of optimizer state (mixed-precision Adam: 2, 2 and K = 12 for the fp32
master weights, momentum and variance; fp32 Adam: 4, 4 and K = 8). Per rank:

  stage 0 (DDP)      (2 + 2 + K)·Ψ
  stage 1 (P_os)     2Ψ + 2Ψ + K·Ψ/N
  stage 2 (P_os+g)   2Ψ + (2 + K)·Ψ/N
  stage 3 (P_os+g+p) (2 + 2 + K)·Ψ/N
The tests compare minitrain's measured bytes with these, and scripts/zero_memory_table.py
reproduces the paper's 7.5B-parameter, 64-GPU example with the same code.
"""


def model_state_bytes(psi, n, stage, param_bytes=2, grad_bytes=2, k=12):
    """{'params', 'grads', 'optimizer_state', 'total'} bytes per rank under ZeRO ``stage`` (0-3)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    params = param_bytes * psi / (n if stage >= 3 else 1)
    grads = grad_bytes * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer_state": optimizer, "total": params + grads + optimizer}


FP32_ADAM = dict(param_bytes=4, grad_bytes=4, k=8)
MIXED_PRECISION_ADAM = dict(param_bytes=2, grad_bytes=2, k=12)
