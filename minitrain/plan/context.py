"""The planner's context-parallel axis (cp): each rank holds s/cp of every sequence.

Context parallelism (Liu et al. 2023's ring attention; Jacobs et al. 2023's DeepSpeed-Ulysses): each of
cp ranks holds s/cp of every sequence (zig-zag: two chunks of s/(2cp), so causal work is even), so every
per-token activation is divided by cp. Ring: the K, V blocks go cp-1 hops round the ring forward, K, V
and their gradients cp-1 hops backward; no score matrix is kept (context_parallel/ring.py keeps the log-sum-
exp and the output; the K, V, dK, dV blocks in transit are a backward's transient); causal blocks above
the diagonal are skipped: (cp+1)/2 of the cp blocks per rank. Ulysses: four all-to-alls each way (q, k,
v to head-sharded, the output back to sequence-sharded), the attention on a/(t·cp) heads over the whole
sequence (its score matrix kept, as one process keeps it; the head-sharded q, k, v and output take the
sequence-sharded ones' place, the same size). Parameters are replicated over cp: gradients are reduced
over dp·cp ranks. Measured against the job (h-cp's GPT3D): Ulysses the ledger's count, ring within 1.5%.
Not modelled (refused in one line): cp not dividing s (2cp: the ring's zig-zag) or, for Ulysses, the heads a tp
rank holds; the message names the nearest valid cp. Experts under cp: plan/experts.py.
"""
from .layout import LayoutError, PRECISIONS, _choices, _nearest


def check_cp(model, layout):
    """Raise LayoutError where the cp layout cannot split the sequence or the heads, naming the nearest valid."""
    if layout.cp_method not in ("ring", "ulysses"):
        raise LayoutError(f"--cp-method must be ring or ulysses, got {layout.cp_method!r}")
    c, s = layout.cp, model.block_size
    heads, room = model.n_head // layout.tp, layout.world // (layout.pp * layout.tp)   # cp x dp fill the room
    if c > 1 and layout.cp_method == "ring" and s % (2 * c):
        valid = [1] + [d for d in range(2, room + 1) if room % d == 0 and s % (2 * d) == 0]   # 1: no zig-zag
        raise LayoutError(f"--block-size {s} is not divisible by 2 x --cp {c} (ring attention's zig-zag: two chunks "
                          f"per rank); nearest valid --cp: {_choices(_nearest(c, valid))}")
    if c > 1 and layout.cp_method == "ulysses" and (s % c or heads % c):
        valid = [d for d in range(1, room + 1) if room % d == 0 and s % d == 0 and heads % d == 0]
        raise LayoutError(f"Ulysses over --cp {c} needs it to divide --block-size {s} and the {heads} heads per tp "
                          f"rank; nearest valid --cp: {_choices(_nearest(c, valid))}")


def local_tokens(model, layout):
    """Tokens of one sequence on a rank: s/cp."""
    return model.block_size // layout.cp


def attention_core_values(model, layout, rows):
    """The attention core's own kept values beyond q, k, v and its output: one process's (and Ulysses')
    softmax output (dropout's mask and output too), ring attention's log-sum-exp and output."""
    a, s, t, c = model.n_head, model.block_size, layout.tp, layout.cp
    if c > 1 and layout.cp_method == "ring":
        return rows * (a // t) * (s // c) + rows * (s // c) * model.n_embd / t
    return rows * (a // t) // c * s * s * (3 if model.dropout else 1)


def cp_block_bytes(model, layout, rows):
    """Bytes of one K or V block (ring) or one of q, k, v, out (Ulysses) on a rank: rows x s/cp x h/t."""
    return rows * local_tokens(model, layout) * model.n_embd // layout.tp * PRECISIONS[layout.precision]


def ring_attention_work(heads, s, d, cp, dropout=False):
    """(forward, backward) Work of parallel/context_parallel/ring.py on one rank: ``heads`` (rows x heads)
    queries of s = T/cp positions in two zig-zag chunks of c = s/2; per chunk pair it computes (the causal
    ones, as _pairs yields them), the scores' product, scale (a diagonal pair: its mask), running max,
    exp, sum and the output's update, and in backward the scores again, the probabilities, dV, dS, dQ and
    dK; the heads' rows of m, l and o are small. One graph node. With ``dropout`` forward and backward
    each draw the queries' rows of the mask (s x T per head) and multiply each pair's weights by it (backward
    twice: P∘Z and dP∘Z); those rows are a transient of s·T per head, not kept between the two."""
    from ..parallel.context_parallel.ring import _pairs
    from .work import Work
    kinds = [kind for step in range(cp) for _, _, kind, _ in _pairs("zigzag", cp, 0, step, True)]
    pairs, diagonal = len(kinds), kinds.count("diagonal")
    c = s // 2
    P, O, R = heads * c * c, heads * c * d, heads * c            # a pair's scores, output rows, row statistics
    fwd, bwd = Work(), Work()
    fwd.ring_pairs = bwd.ring_pairs = pairs          # their Python beyond the arithmetic: calibrated per pair
    fwd.matmul(c, d, c, heads, times=pairs).matmul(c, c, d, heads, times=pairs)
    fwd.elementwise("simple", P, 2 * pairs + diagonal).elementwise("transcendental", P, pairs)
    fwd.elementwise("reduce", P, 2 * pairs).elementwise("simple", O, 2 * pairs)
    fwd.elementwise("simple", R, 6 * pairs).elementwise("transcendental", R, pairs)
    fwd.elementwise("simple", O + R, 2).op("copy", 2 * (O + R))      # o / l, m + log l, both concatenated
    fwd.nodes += 1
    bwd.matmul(c, d, c, heads, times=2 * pairs).matmul(c, c, d, heads, times=3 * pairs)
    bwd.elementwise("simple", P, 4 * pairs + diagonal).elementwise("transcendental", P, pairs)
    bwd.elementwise("inplace", O, 3 * pairs).elementwise("simple", O, 2 * pairs)
    bwd.elementwise("reduce", 2 * O, 1).op("zeros", 3 * O * 2)      # delta; dq, dk, dv zeroed
    if dropout:
        fwd.op("dropout", heads * s * s * cp).elementwise("simple", P, pairs)
        bwd.op("dropout", heads * s * s * cp).elementwise("simple", P, 2 * pairs)
    return fwd, bwd
