"""One step replayed as minitrain's memory ledger sees it, its peak bytes per category: step_walk for a rank
that runs every piece on one micro-batch (forward, zero_grad, backward in reverse, the optimizer step;
ZeRO-3 one gathered unit and two staging buffers at a time), pipeline_walk for a pipeline stage along its
schedule's actions. What each piece keeps for backward is plan/activations.py's.
"""
from functools import lru_cache

from .layout import PRECISIONS, Layout
from .states import CATEGORIES, fp32_step_grads, optimizer_bytes, zero3_share


def step_walk(pieces, layout, dp):
    """Peak bytes per category, of the total, and each category at the total's peak, for a rank that runs
    every piece on one micro-batch: forward, ``zero_grad`` (the jobs call it after forward: last step's
    gradients are alive until then), backward in reverse, the optimizer step. ZeRO stage ``layout.zero``
    over ``dp`` ranks."""
    e = PRECISIONS[layout.precision]
    z, n, N, host = layout.zero, sum(p.params for p in pieces), dp, layout.offload
    pad = -(-n // N) * N if z else n                          # ZeRO-1/2: one flat buffer padded to N
    unit_pad = lambda u: -(-sum(u) // N) * N                  # noqa: E731  ZeRO-3: one flat buffer per unit
    units = [u for p in pieces for u in p.units]
    shards = zero3_share(units, N) if z == 3 else 0
    state_n = {0: n, 1: pad // N, 2: pad // N, 3: shards}[z]  # parameters this rank's optimizer steps
    live = dict.fromkeys(CATEGORIES, 0)
    peak = dict.fromkeys(CATEGORIES, 0)
    peak_total = 0
    at_peak = dict.fromkeys(CATEGORIES, 0)

    def moment(**extra):
        nonlocal peak_total, at_peak
        now = {c: live[c] + extra.get(c, 0) for c in CATEGORIES}
        for c in CATEGORIES:
            peak[c] = max(peak[c], now[c])
        if sum(now.values()) > peak_total:
            peak_total, at_peak = sum(now.values()), now

    # what the previous step left: parameters, optimizer state, gradients (set to None after forward)
    live["params"] = e * {0: n, 1: pad, 2: pad, 3: (0 if host else shards) + len(units)}[z]  # + 0-d placeholders
    live["optimizer_state"] = optimizer_bytes(state_n, layout)
    grads_prev = {0: e * n, 1: e * pad, 2: e * pad // N, 3: 0 if host else e * shards}[z]
    live["grads"] = grads_prev
    # (ExpertDataParallel's buckets hold the dense gradients: the experts' are reduced over their own group)
    ddp_buckets = 0 if layout.local_sgd_every or layout.extras.get("no_ddp_buffers") else \
        2 * e * (n - layout.extras.get("ddp_excluded_params", 0))
    live["comm_buffers"] = {0: ddp_buckets, 1: e * pad // N, 2: e * pad, 3: 0}[z]
    live["activations"] = sum(p.shared for p in pieces)
    for p in pieces:                                          # forward (ZeRO-3: one unit gathered at a time)
        if z == 3 and p.units:
            moment(params=e * max(unit_pad(u) for u in p.units))
        live["activations"] += p.kept
        moment(params=e * unit_pad(p.units[-1]) if z == 3 and p.units else 0)
    if z != 1:
        live["grads"] -= grads_prev                           # zero_grad (ZeRO-1 zeroes its flat buffer in place)
    staging_prev = shard_prev = 0
    for p in reversed(pieces):                                # backward
        below = live["activations"] - p.kept
        live["activations"] = below + p.peak                  # recomputed: its layers' activations again
        # gathered by the recomputation, each unit kept until its reduce-scatter
        held = e * sum(unit_pad(u) for u in p.units) if p.unhooked else None
        for q in reversed(p.parts):
            # a unit's staging is made once its node has run: what that node alone saved is gone by then (not
            # in a recomputed segment, whose input the checkpoint holds through the segment's backward)
            early = z == 3 and bool(q.units) and not p.unhooked
            if early:
                live["activations"] -= q.kept + (p.input_freed_first if q is p.parts[0] else 0)
            if z == 3:      # per unit: gathered again, one full gradient, its staging beside the previous one's
                if not q.units:     # a layer without parameters (ReLU): the recomputed segment's units still held
                    moment(params=held or 0, comm_buffers=staging_prev)
                for u in reversed(q.units):
                    gathered = held if held is not None else e * unit_pad(u)
                    moment(params=gathered, grads=e * max(u), comm_buffers=e * unit_pad(u) + staging_prev)
                    live["grads"] += 0 if host else shard_prev    # the previous unit's reduce-scatter completes
                    staging_prev, shard_prev = e * unit_pad(u), e * unit_pad(u) // N
                    if held is not None:
                        held -= e * unit_pad(u)
            elif z == 2:
                moment(grads=e * max(q.sizes, default=0))     # one full gradient at a time, then staged
            else:           # each moment of its backward, with the gradients it has made by then (z = 0 creates them)
                for act, made in (q.moments if q is p else ((p.peak, 0),)):
                    moment(activations=act - p.peak, grads=e * made if z == 0 else 0)
                live["grads"] += e * q.params if z == 0 else 0
            if q is not p and not early:
                live["activations"] -= q.kept
        live["activations"] = below
    live["grads"] = {0: e * n, 1: e * pad, 2: e * pad // N, 3: 0 if host else e * shards}[z]
    moment()
    moment(grads=fp32_step_grads(state_n, layout))            # the optimizer step (mixed: fp32 gradients)
    return peak, peak_total, at_peak


def pipeline_walk(actions, chunks, layout, local_params, others, sizes=None, step_grads=None):
    """Peak bytes for one pipeline stage (per category, total, each category at the total's peak): its
    actions in the schedule's order. A forward adds its chunk's kept activations; a backward goes through
    its pieces in reverse (recomputed ones at their peak), creating their gradients (None before the step)
    the first time, then frees the chunk; split in B and W (zero-bubble schedules), B frees all but each piece's
    ``deferred`` bytes and makes no gradient, W frees those and makes them. ``chunks``: chunk -> list of
    Pieces; ``others``: parameter tensors of other stages (0-d placeholders). The moments are (activations,
    gradients) pairs, the worst by their sum (then by activations, so that both walks pick the same).
    ``sizes``: the micro-batches' rows where a batch is cut unevenly (the first ones one row more; the pieces
    count the largest; then ``actions`` is the schedule's list): what a micro-batch keeps scales with its rows.
    ``step_grads``: the fp32 gradient bytes held while the optimizer steps, where not its whole shard's."""
    e = PRECISIONS[layout.precision]
    # ZeRO on the stage (parallel/zero_3d.py), over its dp x cp replicas (one too: a communicator of one): a
    # flat gradient buffer of the whole stage through the step (stage 1 keeps it between steps, 2 and 3 a shard
    # of it, which the reduce-scatter lands in; stage 3 also keeps a shard of the parameters and gathers the
    # stage once per step)
    z, N = layout.zero, layout.zero_ranks
    zero1 = z >= 1
    pad = -(-local_params // N) * N if zero1 else local_params
    g = e * pad if zero1 else 0
    if len(chunks) == 1 and not isinstance(actions, list):     # one chunk: the schedule's in-flight counts
        K, F, A, G, shared = _chunk_backward(tuple(chunks[0]), 0 if zero1 else e)
        # the worst moments are backwards: a forward never has more in flight than the next backward,
        # and a backward holds at least its own micro-batch's kept bytes (A >= K, F >= K)
        b_first, b_later = actions
        act_peak = (max(b_first, b_later) - 1) * K + A
        dyn = _worst(((b_first - 1) * K + F[0], g + F[1]), ((b_later - 1) * K + A, g + G) if b_later else (0, 0))
        g += G
    else:
        kept, first, again, grads, shared, split_b, split_w = {}, {}, {}, {}, 0, {}, {}
        split = any(a.kind == "W" for a in actions)       # zero-bubble: B and W free apart
        for c, ps in chunks.items():
            kept[c], first[c], again[c], grads[c], sh = _chunk_backward(tuple(ps), 0 if zero1 else e)
            if split:
                split_b[c], split_w[c] = _chunk_split(tuple(ps), 0 if zero1 else e)
            shared += sh
        act = act_peak = 0
        dyn = (0, 0)
        seen = set()
        for a in actions:
            w = sizes[a.microbatch] / sizes[0] if sizes else 1       # its rows over the largest's
            if a.kind == "F":
                act += w * kept[a.chunk]
                act_peak, dyn = max(act_peak, act), _worst(dyn, (act, g))
                continue
            if split and a.kind == "B":
                # zero-bubble B: input gradients only; what the weights' nodes saved stays for W (no gradient yet)
                others_act = act - w * kept[a.chunk]
                worst, held = split_b[a.chunk]
                act_peak = max(act_peak, others_act + w * worst)
                dyn = _worst(dyn, (others_act + w * worst, g))
                act = others_act + w * held
                continue
            if a.kind == "W":           # the weights' gradients, made as what B left is freed, node by node
                fresh = a.chunk not in seen
                # a later W makes no gradient, so its first moment (nothing freed yet) is its worst: freed only grows
                for freed, made in (split_w[a.chunk] if fresh else split_w[a.chunk][:1]):
                    dyn = _worst(dyn, (act - w * freed, g + (made if fresh else 0)))
                act -= w * split_w[a.chunk][-1][0]
                if fresh:
                    seen.add(a.chunk)
                    g += grads[a.chunk]
                continue
            others_act = act - w * kept[a.chunk]
            fresh = a.chunk not in seen
            act_peak = max(act_peak, others_act + w * again[a.chunk])
            dyn = _worst(dyn, (others_act + w * first[a.chunk][0], g + first[a.chunk][1]) if fresh
                         else (others_act + w * again[a.chunk], g))
            act = others_act
            if fresh:
                seen.add(a.chunk)
                g += grads[a.chunk]
    states, moments = _step_end(g, local_params, others, step_grads, layout.precision, z, N, layout.optimizer,
                                layout.offload)
    peak = {"params": states["params"], "grads": states["grads"], "activations": act_peak + shared,
            "optimizer_state": states["optimizer_state"], "comm_buffers": states["comm_buffers"]}
    at_peak = {**peak, "activations": dyn[0] + shared, "grads": dyn[1]}    # (the shard made again by the step's end)
    total = sum(at_peak.values())
    for moment, moment_total in moments:
        if moment_total > total:
            at_peak, total = {**peak, **moment}, moment_total
    return peak, total, at_peak


@lru_cache(maxsize=4096, typed=True)
def _step_end(grads, local_params, others, step_grads, precision, zero, zero_ranks, optimizer, offload):
    """A stage's peaks of every category but activations (0 here: pipeline_walk's own), and the moments after
    its last backward, activations freed: the reduce-scatter's and the optimizer step's, each with its total
    (summed in the peak's order, as pipeline_walk sums its own). ``grads``: the gradient bytes at the last
    backward's end (ZeRO: the flat buffer). Cached: stages alike but for their micro-batches in flight share
    it, and its arguments are all it reads (typed: an int and an equal float apart, their sums' types)."""
    e, z, N = PRECISIONS[precision], zero, zero_ranks
    states_of = Layout(precision=precision, optimizer=optimizer, offload=offload)   # what the two below read
    zero1 = z >= 1
    pad = -(-local_params // N) * N if zero1 else local_params
    stepped = pad // N if zero1 else local_params              # what this rank's optimizer steps
    if step_grads is None:        # mixed precision's fp32 gradients while stepping (given: plan/experts.py's)
        step_grads = fp32_step_grads(stepped, states_of)
    shard_g = e * pad // N if z >= 2 else 0                     # stages 2, 3: the gradient shard
    shard_p = e * pad // N + e if z == 3 else 0                 # stage 3: the parameter shard, a 0-d placeholder
    # after the last backward, its activations freed: the reduce-scatter (the stage whole, its flat gradient and
    # the shard it lands in), then the optimizer step (at stages 2 and 3 the flat gradient freed, at 3 the gathered
    # stage; mixed precision's fp32 gradients held while it steps)
    reduced = {"params": e * (pad + others) + shard_p, "grads": grads + shard_g, "activations": 0}
    step = {"params": e * others + (e * pad if z < 3 else 0) + shard_p, "activations": 0,
            "grads": (grads if z < 2 else 0) + step_grads + shard_g}
    peak = {"params": reduced["params"], "grads": max(reduced["grads"], step["grads"]),
            "activations": 0, "optimizer_state": optimizer_bytes(stepped, states_of),
            "comm_buffers": e * pad // N if z == 1 else 0}
    return peak, tuple((moment, sum({**peak, **moment}.values())) for moment in (reduced, step))


def _worst(a, b):
    """The heavier of two (activations, gradients) moments: by their sum, then by activations (a on a tie)."""
    total_a, total_b = a[0] + a[1], b[0] + b[1]
    return b if total_b > total_a or (total_b == total_a and b[0] > a[0]) else a


@lru_cache(maxsize=4096)
def _chunk_split(pieces, grad_bytes):
    """A chunk's backward split in B and W (zero-bubble schedules): B's worst activations and what it leaves
    for W (each piece's ``deferred``, held once its B has passed); W's moments (deferred bytes freed, gradient
    bytes made so far), node by node in B's order (``Piece.w_nodes``), from (0, 0): both only grow."""
    below = sum(p.kept for p in pieces)
    held, worst = 0, []
    for p in reversed(pieces):
        below -= p.kept
        worst += [below + held + act for act, _ in p.moments]
        held += p.deferred
    worst.append(held)
    freed = made = 0
    moments = [(0, 0)]
    for p in reversed(pieces):
        for node_freed, node_params in p.w_nodes:   # a node frees what it saved, then its gradients are made
            assert node_freed >= 0, node_freed          # pipeline_walk takes a later W's first moment as its worst
            freed, made = freed + node_freed, made + grad_bytes * node_params
            moments.append((freed, made))
    return (max(worst), held), tuple(moments)


@lru_cache(maxsize=4096)
def _chunk_backward(pieces, grad_bytes):
    """A chunk's kept activations; its worst (activations, new gradients) inside its first backward and
    its worst activations in a later one; its gradients; its step-long shared bytes."""
    kept = below = sum(p.kept for p in pieces)
    new, moments = 0, []
    for p in reversed(pieces):
        below -= p.kept
        moments += [(below + act, new + grad_bytes * made) for act, made in p.moments]
        new += grad_bytes * p.params
    moments.append((0, new))
    return (kept, max(moments, key=lambda m: (m[0] + m[1], m[0])), max(a for a, _ in moments), new,
            sum(p.shared for p in pieces))
