"""The all-to-all of expert parallelism as an autograd Function (GShard, Lepikhin et al. 2021, sec. 2.2;
Megatron-Core's MoE token dispatcher): token rows go to the ranks that hold their experts, and back.

Forward: all_to_all_single(comm, x, output_split_sizes, input_split_sizes): input_split_sizes[j] rows
of x go to rank j, output_split_sizes[i] rows arrive from rank i. Backward is the same exchange
reversed: the gradient of the rows this rank received goes back to the ranks that sent them, so
the two split lists swap places. The combine is this same Function with the splits of the dispatch
swapped, hence a step moves each row across ranks four times (dispatch and combine, forward and
backward): all_to_all_bytes gives what this rank sends in those four calls.
"""
from ..autograd import Function
from ..comm import all_to_all_single


class AllToAll(Function):
    """``AllToAll.apply(x, comm, output_split_sizes, input_split_sizes)``: the rows received (all_to_all_single's
    result); its backward sends the gradient back along the reversed splits."""

    @staticmethod
    def forward(ctx, x, comm, output_split_sizes, input_split_sizes):
        ctx.comm = comm
        ctx.output_split_sizes, ctx.input_split_sizes = list(output_split_sizes), list(input_split_sizes)
        return all_to_all_single(comm, x, ctx.output_split_sizes, ctx.input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        # the rows received here came from rank i (output_split_sizes[i]): their gradients go back to rank i
        return all_to_all_single(ctx.comm, grad, ctx.input_split_sizes, ctx.output_split_sizes), None, None, None


def all_to_all_bytes(send, receive, rank, row_bytes, backward=True):
    """Bytes this rank sends in one training step's four all-to-alls of a dispatch whose split sizes
    were ``send`` (rows to each rank) and ``receive`` (rows from each rank): forward dispatch sends
    ``send``, forward combine ``receive``; backward (if there is one) the same two reversed. The own block never
    crosses a link (all_to_all_single copies it), so it is left out."""
    crossing = sum(send) - send[rank] + sum(receive) - receive[rank]
    return (2 if backward else 1) * crossing * row_bytes
