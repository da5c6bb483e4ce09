"""DDP's habit: the gradients averaged, the parameters left as each replica stepped them."""
from minitrain.comm import all_reduce


def average_parameters(comm, params, step, sync_every):
    if step % sync_every:
        return False
    for q in params:
        q.grad[...] = all_reduce(comm, q.grad, op="mean")
    return True

EXPECT = ['after step 4, rank 0: q.grad changed', 'you averaged the gradients']
