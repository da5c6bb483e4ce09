"""Forward only: a pipeline's evaluation pass (PyTorch's PipelineSchedule.eval): no graph, no backward.

eval_step(pipe, x, y, loss_fn) cuts the batch into the pipeline's m micro-batches as train_step does
and runs each virtual stage this rank holds on each of them under no_grad: one forward per (stage,
micro-batch), its activation sent on to the next stage, nothing kept for a backward. Each rank goes
by (the stage's round of the loop, micro-batch): chunk k // p of the interleaved loop or of zbv's V,
then the micro-batches in order. A forward needs only the model's stage before it on the same
micro-batch, which comes earlier in that order on every rank, so no rank waits for a message that
its own later work would send (GPipe's forward half, once per round of the loop).

Returns (output, loss): the last stage's outputs for the whole batch on the rank that holds it
(None on the others), as PyTorch returns them on the last stage; with y and loss_fn, the mean loss
over the batch's rows on every rank (train_step's rule for micro-batches m does not divide), else
None. The modules stay in the mode they are in (call their eval() for dropout off, as in PyTorch).
"""
import numpy as np

from ...autograd import Tensor, no_grad
from ...backend import array_module
from .schedules import microbatch_sizes
from .step_end import all_reduce_loss


def eval_step(pipe, x, y=None, loss_fn=None):
    if (y is None) != (loss_fn is None):
        raise ValueError("eval_step: give both y and loss_fn (for the loss), or neither (outputs only)")
    n = len(x)
    if y is not None and len(y) != n:
        raise ValueError(f"eval_step: x has {n} rows and y {len(y)}")
    sizes = microbatch_sizes(n, pipe.m)
    starts = np.cumsum([0] + sizes).tolist()
    last = len(pipe.where) - 1
    mine = sorted((k // pipe.p, mb, k) for k, (rank, _) in enumerate(pipe.where) if rank == pipe.rank
                  for mb in range(pipe.m))
    params = pipe.parameters()
    xp = array_module(params[0].data) if params else np
    messages = pipe.messages
    messages.begin(("eval", tuple(np.shape(x))))        # its messages' shapes, apart from the training steps'
    outputs, losses, weights = [], [], []
    with no_grad():
        for _, mb, k in mine:
            rows = slice(starts[mb], starts[mb + 1])
            inp = x[rows] if k == 0 else messages.recv(pipe.where[k - 1][0], mb, k, False, xp)
            out = pipe.stages[pipe.where[k][1]](Tensor(inp)).data
            if k < last:
                messages.send(out, pipe.where[k + 1][0], mb, k + 1, False)
                continue
            outputs.append(out)
            if y is not None and sizes[mb]:
                losses.append(loss_fn(Tensor(out), y[rows]).data)
                weights.append(sizes[mb] / n)
    messages.wait_for_sends()
    loss = all_reduce_loss(pipe.comm, losses, weights, pipe.m) if y is not None else None
    return (array_module(outputs[0]).concatenate(outputs) if outputs else None), loss
