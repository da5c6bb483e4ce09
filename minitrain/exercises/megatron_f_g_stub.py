"""Exercise: Megatron's conjugate operators f and g (Shoeybi et al. 2019, sec. 3, Figure 3).

A tensor-parallel MLP Y = ReLU(X A) B over t ranks: rank r holds columns A_r of A and rows B_r of
B and computes ReLU(X A_r) B_r, a partial sum of Y. Two autograd functions make this exact:

  f(x, comm): forward the identity; backward the sum over the ranks of the incoming gradients
              (each rank's dX is only its columns' share of the full dX).
  g(x, comm): forward the sum over the ranks (adds the partial products); backward the identity.

    y = g(linear(relu(linear(f(x), A_r)), B_r))

Write the four static methods below with ``minitrain.comm.ring_all_reduce(comm, array)`` (it sums
an array over the ranks and returns a new one). Forward and backward receive and return raw arrays
(backward returns one gradient per forward input: None for ``comm``).

Check it:  python -m minitrain.exercises check megatron_f_g path/to/this_file.py
"""
from minitrain.autograd import Function
from minitrain.comm import ring_all_reduce  # noqa: F401  (you will need it)


class CopyToTensorParallelRegion(Function):       # f
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        # EXERCISE
        raise NotImplementedError("megatron_f_g: write f's forward and backward")

    @staticmethod
    def backward(ctx, grad):
        # EXERCISE
        raise NotImplementedError("megatron_f_g: write f's forward and backward")


class ReduceFromTensorParallelRegion(Function):   # g
    @staticmethod
    def forward(ctx, x, comm):
        # EXERCISE
        raise NotImplementedError("megatron_f_g: write g's forward and backward")

    @staticmethod
    def backward(ctx, grad):
        # EXERCISE
        raise NotImplementedError("megatron_f_g: write g's forward and backward")


def megatron_f_g():
    """What the grader imports: the two functions."""
    return CopyToTensorParallelRegion, ReduceFromTensorParallelRegion
