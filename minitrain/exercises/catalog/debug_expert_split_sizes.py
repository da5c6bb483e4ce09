"""Debugging exercise: an expert-parallel layer (GShard, Lepikhin et al. 2021) whose send split
sizes count the tokens by a different expert-to-rank map than the one the experts live by, so
all_to_all_single's check_collectives stops every rank with the pairs of ranks and sizes that
disagree. Grader: the fixed program finishes and every rank's token outputs equal one process at
p = 1..4 (1e-12)."""
import numpy as np

from ..debugging import load_program, program_checks, run_report

TITLE = "debug: an expert-parallel exchange whose split sizes disagree"
ORDER = 250
KIND = "debug"
NOTEBOOK = "14_experts"
DEFINES = "train"
TOKENS, EXPERTS, DIM = 6, 12, 3

STUB = '''"""Debugging exercise debug_expert_split_sizes: expert parallelism whose ranks disagree on sizes.

train(comm) runs one mixture-of-experts layer, expert-parallel: 12 experts, rank r holds experts
r*per .. r*per+per-1 (per = 12 / p), every rank routes its own 6 tokens (top-1: the best expert,
weighted by its gate), sends each token row to the rank that holds its expert with
all_to_all_single, the experts compute tanh(row @ W_e), and a second all_to_all_single brings the
rows home. It should return the (6, 3) outputs of this rank's tokens, equal to one process that
applies every expert itself. On one rank it does. On two, every rank stops with an error.

Run it and read what minitrain reports (which rank sends how many rows to which, and how many
that rank expects):

    python -m minitrain.exercises run debug_expert_split_sizes
    python mine.py                       (the same, on your copy)

Then fix your copy and check it:

    python -m minitrain.exercises check debug_expert_split_sizes mine.py
"""
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
    send = np.bincount(expert % p, minlength=p).tolist()      # rows for each rank

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
'''

FIX = (("    send = np.bincount(expert % p, minlength=p).tolist()      # rows for each rank",
        "    send = np.bincount(expert // per, minlength=p).tolist()   # rows for each rank: expert e is on rank e // per"),)

HINTS = (
    "Read the report: rank i sends some rows to rank j, which expects another number. Which of the "
    "two numbers follows from where the experts live? Work it out by hand at p = 2 for one rank.",
    "The rows are sorted by expert, and rank j holds experts j*per .. j*per+per-1, so the send "
    "split sizes must count each rank's block of experts. receive is computed that way; send is not: "
    "expert % p is a round-robin placement the experts do not follow.",
    "Count the rows by owner, expert // per: send = np.bincount(expert // per, minlength=p).tolist().",
)


def _one_process():
    """Every token of every rank through its expert in one process: {p: [(6, 3) per rank]}."""
    rng = np.random.default_rng(0)
    router = rng.standard_normal((DIM, EXPERTS))
    weights = rng.standard_normal((EXPERTS, DIM, DIM))

    def rank_out(r):
        x = np.random.default_rng(1 + r).standard_normal((TOKENS, DIM))
        logits = x @ router
        expert = logits.argmax(axis=1)
        prob = np.exp(logits - logits.max(axis=1, keepdims=True))
        gate = prob.max(axis=1) / prob.sum(axis=1)
        return np.tanh(np.einsum("nd,nde->ne", x, weights[expert])) * gate[:, None]
    return rank_out


def compare(p, results):
    rank_out = _one_process()
    problems = []
    for r, got in enumerate(results):
        want = rank_out(r)
        got = np.asarray(got)
        if got.shape != want.shape:
            problems.append(f"rank {r}: returned shape {got.shape}, expected {want.shape} (one row per token)")
            continue
        wrong = ~np.isclose(got, want, rtol=1e-12, atol=1e-12).all(axis=1)
        if wrong.any():
            problems.append(f"rank {r}: {int(wrong.sum())} of {TOKENS} token rows differ from one process "
                            f"(tokens {np.flatnonzero(wrong).tolist()}): a row went to a rank that does not hold "
                            "its expert, or came home to the wrong place")
    return problems


def broken():
    return load_program("debug_expert_split_sizes", STUB).train


def reference():
    return load_program("debug_expert_split_sizes", STUB, FIX, "fixed").train


def checks():
    return program_checks(compare, hint=1, label="finishes, and every token's output equals one process")


def run(impl, p):
    return run_report("debug_expert_split_sizes", impl, p or 2, compare)
