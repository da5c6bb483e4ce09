"""Grader: the paged KV cache's block table (Kwon et al. 2023, PagedAttention, sec. 4.3, Figs. 6 and 8):
each new token's slot (table[p // block_size], p % block_size); a block taken when its first token
comes, never ahead; a block shared with another sequence copied before a token is written into it,
and only then, the shared one released; the library's paged cache, serving with the learner's
append_slots and shared prefixes, gives the logits of a plain forward (float64, 1e-10)."""
from contextlib import contextmanager

import numpy as np

from ..comparing import host
from ..grading import Check, Mismatch
from ..oracles import RecordingBlockPool

TITLE = "the paged KV cache's block table: slots on demand, copy-on-write for shared prefixes"
ORDER = 187
KIND = "implement"
NOTEBOOK = "11_inference"
DEFINES = "append_slots"

STUB = '''"""Exercise paged_append_slots: vLLM's paged KV cache (Kwon et al. 2023, "Efficient Memory
Management for Large Language Model Serving with PagedAttention", sec. 4.3) keeps every sequence's
keys and values in fixed-size blocks of block_size tokens from one shared pool. A sequence's block
table maps its logical block i (its tokens i*block_size .. (i+1)*block_size - 1) to a physical block.
Sequences that start with the same prompt share the blocks of that prefix; the pool counts, per
block, how many tables hold it (refcount).

Write append_slots(table, start, num_new, block_size, pool): the sequence holds `start` tokens and
is about to write num_new more, at positions start .. start + num_new - 1. Make its table hold them
and say where each one goes.

Contract:
  - table is the sequence's block table, a list of physical block ids: change it in place;
  - pool.allocate() returns a free block (its refcount 1), pool.refcount[b] is how many tables hold
    block b, pool.copy(src, dst) copies block src's keys and values into block dst, pool.release(b)
    says one table no longer holds b;
  - the token at position p goes to logical block p // block_size, offset p % block_size;
  - a logical block past the table's end gets a fresh block when its first token comes, never
    ahead: a sequence wastes less than one block;
  - a block other tables hold too (refcount > 1) that a new token writes into is copied first
    (copy-on-write): a fresh block, the shared one's contents copied into it, the fresh one in its
    place in this table, the shared one released; a block only this table holds is written in place;
  - return the new tokens' slots, in order: a list of (physical block, offset) pairs.

The test to pass:
  - the slots and the table for one sequence at block sizes 1, 3, 4 and 16, filled by a prompt
    then token by token;
  - the number of blocks the table holds after each call: ceil(tokens / block_size);
  - two sequences sharing a prefix: what each reads back through its table is what it wrote (or,
    for the shared prefix, what its source wrote); blocks copied only when written; every block's
    refcount the number of tables that hold it;
  - minitrain's paged cache, calling your append_slots, serves prompts with a shared prefix with
    the logits of a plain forward (float64, 1e-10).

Check it:  python -m minitrain.exercises check paged_append_slots mine.py
Stuck?     python -m minitrain.exercises hint paged_append_slots
"""


def append_slots(table, start, num_new, block_size, pool):
    raise NotImplementedError("append_slots: blocks on demand, copy-on-write, then the slots")
'''

HINTS = (
    "Which logical blocks do the new tokens touch? From start // block_size to (start + num_new - 1) // "
    "block_size. Only those can need work: one past the table's end needs a block, one that another "
    "sequence holds too needs a copy. Every other block is written in place.",
    "For i in that range: if i == len(table), table.append(pool.allocate()); elif pool.refcount[table[i]] > "
    "1, the block is shared: take fresh = pool.allocate(), copy the shared block into it, release the shared "
    "one and put fresh at table[i]. Never allocate for a logical block no new token reaches.",
    "After the loop: return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]. "
    "The copy goes from the shared block to the fresh one: pool.copy(table[i], fresh), then "
    "pool.release(table[i]), then table[i] = fresh.",
)


def _call(impl, table, start, num_new, block_size, pool):
    """impl's slots as [(block, offset)], checked for shape; what was asked, for explanations."""
    before = list(table)
    what = f"append_slots(table={before}, start={start}, num_new={num_new}, block_size={block_size}, pool)"
    got = impl(table, start, num_new, block_size, pool)
    try:
        slots = [(int(b), int(o)) for b, o in got]
    except (TypeError, ValueError):
        raise Mismatch(f"{what} returned {got!r:.80}, expected a list of {num_new} (block, offset) pairs") from None
    if len(slots) != num_new:
        raise Mismatch(f"{what} returned {len(slots)} slots, expected one per new token: {num_new}")
    if not isinstance(table, list) or any(not isinstance(b, (int, np.integer)) for b in table):
        raise Mismatch(f"after {what} the table is {table!r:.80}, expected a list of block ids (changed in place)")
    need = -(-(start + num_new) // block_size)
    if table == before and len(table) < need:
        raise Mismatch(f"after {what} the table is still {before}, where {need} blocks hold {start + num_new} tokens: "
                       "change the table the caller passed in place (table.append, table[i] = ...), the cache reads "
                       "it after the call")
    return slots, what


def _expect_slots(slots, table, start, block_size, what):
    for k, (b, o) in enumerate(slots):
        p = start + k
        i = p // block_size
        if i >= len(table):
            raise Mismatch(f"{what}: position {p} is in logical block p // block_size = {i}, but the table "
                           f"{table} has only {len(table)} blocks: a block is needed when its first token comes")
        if (b, o) != (table[i], p % block_size):
            raise Mismatch(f"{what}: the slot of position {p} is (block {b}, offset {o}), expected (block "
                           f"{table[i]}, offset {p % block_size}): position p lives in logical block p // "
                           f"block_size = {i}, i.e. the physical block table[{i}] = {table[i]}, at offset p % "
                           f"block_size = {p % block_size}")


def _expect_blocks(table, tokens, block_size, what):
    need = -(-tokens // block_size)
    if len(table) > need:
        raise Mismatch(f"after {what} the table holds {len(table)} blocks {table} for {tokens} tokens, where "
                       f"ceil({tokens} / {block_size}) = {need} hold them: a block is taken when its first token "
                       "comes, never ahead (a sequence wastes less than one block)")
    if len(table) < need:
        raise Mismatch(f"after {what} the table holds {len(table)} blocks {table} for {tokens} tokens: "
                       f"ceil({tokens} / {block_size}) = {need} are needed")


GROWTH = [(1, [5, 1, 1, 3]), (3, [7, 1, 1, 1, 2, 4]), (4, [4, 1, 3, 1, 8]), (16, [5, 11, 1, 20])]


def _one_sequence(impl, check_blocks):
    for block_size, chunks in GROWTH:
        pool, table, start = RecordingBlockPool(), [], 0
        for n in chunks:
            slots, what = _call(impl, table, start, n, block_size, pool)
            if check_blocks:
                _expect_blocks(table, start + n, block_size, what)
                if pool.held() != len(table):
                    raise Mismatch(f"after {what} the pool has {pool.held()} blocks allocated and the table holds "
                                   f"{len(table)}: every block allocated belongs in the table")
            else:
                _expect_slots(slots, table, start, block_size, what)
            start += n


def _slots(impl):
    _one_sequence(impl, check_blocks=False)


def _on_demand(impl):
    _one_sequence(impl, check_blocks=True)


class Sequences:
    """Tables over one Pool, the labels each sequence wrote, and what each must read back."""

    def __init__(self, impl, block_size):
        self.impl, self.bs, self.pool = impl, block_size, RecordingBlockPool()
        self.tables, self.lengths, self.truth = {}, {}, {}

    def add(self, s, prefix_of=None, length=0):
        self.tables[s], self.lengths[s], self.truth[s] = [], 0, []
        if prefix_of is not None:
            self.tables[s] = self.tables[prefix_of][:-(-length // self.bs)]
            for b in self.tables[s]:
                self.pool.share(b)
            self.lengths[s], self.truth[s] = length, list(self.truth[prefix_of][:length])

    def write(self, s, n):
        start, table = self.lengths[s], self.tables[s]
        mark = len(self.pool.log)
        slots, what = _call(self.impl, table, start, n, self.bs, self.pool)
        _expect_slots(slots, table, start, self.bs, what)
        for k, (b, o) in enumerate(slots):
            self.pool.contents.setdefault(b, {})[o] = (s, start + k)
        self.lengths[s] += n
        self.truth[s] += [(s, start + k) for k in range(n)]
        return what, self.pool.log[mark:]

    def read(self, s, p):
        b = self.tables[s][p // self.bs]
        return self.pool.contents.get(b, {}).get(p % self.bs)

    def expect_reads(self, what):
        for s, truth in self.truth.items():
            for p, want in enumerate(truth):
                got = self.read(s, p)
                if got != want:
                    i = p // self.bs
                    shared = [t for t in self.tables if t != s and i < len(self.tables[t])
                              and self.tables[t][i] == self.tables[s][i]]
                    whose = (f"sequence {got[0]}'s position {got[1]}" if got else "nothing")
                    why = (f"; block {self.tables[s][i]} is in sequence {shared[0]}'s table too: a block other tables "
                           "hold is copied before a token is written into it (pool.copy(shared, fresh)), and the "
                           "copy takes its place in the writer's table" if shared else
                           "; a copy goes from the shared block to the fresh one: pool.copy(src=shared, dst=fresh)")
                    raise Mismatch(f"after {what}: sequence {s} reads {whose} at its position {p} (logical block "
                                   f"{i}, physical {self.tables[s][i]}), expected "
                                   + (f"sequence {want[0]}'s position {want[1]}" if want[0] != s else
                                      f"its own position {p}") + why)

    def expect_refcounts(self, what):
        holders = {}
        for t in self.tables.values():
            for b in t:
                holders[b] = holders.get(b, 0) + 1
        for b in range(len(self.pool.refcount)):
            if self.pool.refcount[b] != holders.get(b, 0):
                raise Mismatch(f"after {what}: block {b} has refcount {self.pool.refcount[b]}, but "
                               f"{holders.get(b, 0)} table(s) hold it: the writer's table let go of the shared "
                               "block when its copy took the place, so release it (pool.release), or it never "
                               "returns to the pool")


def _copies(log):
    return [e for e in log if e[0] == "copy"]


def _copy_on_write(impl):
    seqs = Sequences(impl, block_size=4)
    seqs.add(0)
    seqs.write(0, 6)                              # blocks [0 (4 tokens), 1 (2 tokens)]
    seqs.add(1, prefix_of=0, length=5)            # shares block 0 whole and block 1 for position 4
    what, log = seqs.write(1, 2)                  # positions 5, 6 land in block 1: copy it first
    seqs.expect_reads(what)
    seqs.expect_refcounts(what)
    if len(_copies(log)) != 1:
        raise Mismatch(f"{what} copied {len(_copies(log))} blocks ({_copies(log)}), expected 1: block 1, the one "
                       "both sequences hold that the new tokens write into")
    what, log = seqs.write(0, 1)                  # block 1 is sequence 0's alone now: in place
    seqs.expect_reads(what)
    if _copies(log):
        raise Mismatch(f"{what} copied a block ({_copies(log)}) that only this table holds (refcount 1): a block "
                       "no other table holds is written in place")
    seqs.add(2, prefix_of=0, length=4)            # block 0 whole, full: nothing of it is written again
    what, log = seqs.write(2, 1)
    seqs.expect_reads(what)
    if _copies(log):
        raise Mismatch(f"{what} copied a block ({_copies(log)}) that no new token writes into: sequence 2 shares "
                       "block 0 full, and its position 4 goes to a fresh block; a shared block is copied only "
                       "when written")
    seqs.add(3, prefix_of=0, length=7)            # block 1 partly: a prompt across it and past it
    what, log = seqs.write(3, 6)
    seqs.expect_reads(what)
    seqs.expect_refcounts(what)
    _expect_blocks(seqs.tables[3], 13, 4, what)
    for s in seqs.tables:
        what, _ = seqs.write(s, 1)
        seqs.expect_reads(what)
    seqs.expect_refcounts("every sequence wrote one more token")


@contextmanager
def _in_the_cache(impl):
    from ...inference import kv_cache
    library = kv_cache.append_slots
    kv_cache.append_slots = impl
    try:
        yield
    finally:
        kv_cache.append_slots = library


def _serves_exactly(impl):
    from ... import manual_seed, nn
    from ...inference import LLMEngine
    manual_seed(3)
    model = nn.GPT(nn.GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=2, n_embd=8))
    model.to(np.float64)
    rng = np.random.default_rng(0)
    prefix = list(rng.integers(0, 13, 7))
    prompts = [prefix + list(rng.integers(0, 13, n)) for n in (5, 1, 8, 2)]
    for block_size in (3, 4):
        with _in_the_cache(impl):
            got = LLMEngine(model, cache="paged", block_size=block_size, share_prefix=True).generate(
                prompts, 6, record_logits=True)
        for s, (p, tokens, logits) in enumerate(zip(prompts, got.tokens, got.logits)):
            want = host(model(np.array([p + tokens[:-1]])).data)[0, len(p) - 1:]
            worst = float(np.abs(host(logits) - want).max())
            if not worst < 1e-10:
                raise Mismatch(f"block_size {block_size}, prompts sharing a prefix of 7 tokens: sequence {s}'s logits "
                               f"differ from a plain forward by {worst:.3g}: attention read keys and values from "
                               "slots other than the ones its tokens were written to")
        if got.cow_copies == 0:
            raise Mismatch(f"block_size {block_size}: the prefix's last block was never copied although the "
                           "sequences sharing it wrote their own tokens into it")


def checks():
    return [Check("each new token's slot: (table[p // block_size], p % block_size)", _slots, 1),
            Check("a block taken when its first token comes, never ahead", _on_demand, 2),
            Check("copy-on-write: a shared block copied before it is written, only then, and released", _copy_on_write,
                  2),
            Check("minitrain's paged cache with your append_slots: the logits of a plain forward", _serves_exactly, 3)]


def reference():
    from ...inference.kv_cache import append_slots
    return append_slots
