"""Counts the rows by expert // p, the number of ranks, not expert // per, the experts per rank."""

import numpy as np

from minitrain.comm import all_to_all_single


def train(comm, tokens=6, experts=12, dim=3):
    p, r = comm.size, comm.rank
    per = experts // p                                        # experts on each rank
    rng = np.random.default_rng(0)
    router = rng.standard_normal((dim, experts))
    weights = rng.standard_normal((experts, dim, dim))        # drawn alike on every rank
    mine = weights[r * per:(r + 1) * per]                     # this rank keeps its own experts only
    x = np.random.default_rng(1 + r).standard_normal((tokens, dim))

    logits = x @ router
    expert = logits.argmax(axis=1)                            # top-1 routing
    prob = np.exp(logits - logits.max(axis=1, keepdims=True))
    gate = prob.max(axis=1) / prob.sum(axis=1)
    order = np.argsort(expert, kind="stable")                 # rows grouped by expert

    # how many of each rank's rows are for my experts: every rank sends me its counts of them
    per_expert = np.bincount(expert, minlength=experts)
    counts_in = all_to_all_single(comm, per_expert, [per] * p, [per] * p)
    receive = counts_in.reshape(p, per).sum(axis=1).tolist()
    send = np.bincount(expert // p, minlength=p).tolist()     # rows for each rank

    rows = all_to_all_single(comm, x[order], receive, send)
    ids = all_to_all_single(comm, expert[order], receive, send)
    y = np.tanh(np.einsum("nd,nde->ne", rows, mine[ids - r * per]))
    back = all_to_all_single(comm, y, send, receive)          # home again, in the order sent
    out = np.empty_like(back)
    out[order] = back
    return out * gate[:, None]


if __name__ == "__main__":
    from minitrain.exercises.debugging import main
    main(train, "debug_expert_split_sizes")

EXPECT = ['input_split_sizes must be']
