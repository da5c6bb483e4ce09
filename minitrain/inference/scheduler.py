"""Which sequences run in the next step: continuous batching with preemption (Yu et al. 2022, "Orca";
vLLM's scheduler, Kwon et al. 2023, sec. 4.5). Each step every running sequence gets one token;
finished ones leave, waiting ones join, first come first served. When the paged cache lacks a block,
the latest admitted sequence is preempted whole: swapped to host and back (cost: its K/V over the
host link twice) or freed and recomputed when readmitted (cost: one prefill of its tokens). The
contiguous cache reserves the context on admission: it never preempts, it admits fewer. Decisions
depend only on token counts, so tensor-parallel ranks agree.
"""
from collections import deque

WAITING, RUNNING, SWAPPED, FINISHED = "waiting", "running", "swapped", "finished"


class Sequence:
    """A request: its prompt, the tokens so far, how many of them the cache holds, its own generator
    (so what it samples does not depend on which sequences share its batches)."""

    def __init__(self, seq_id, prompt, max_new_tokens, rng):
        self.id, self.prompt, self.max_new_tokens, self.rng = seq_id, [int(t) for t in prompt], max_new_tokens, rng
        self.tokens = list(self.prompt)
        self.num_cached = 0            # tokens whose K/V are in the cache (on the device or swapped)
        self.status = WAITING
        self.logits = []               # one host row per generated token, if the engine records them

    @property
    def generated(self):
        return self.tokens[len(self.prompt):]

    @property
    def done(self):
        return len(self.tokens) - len(self.prompt) >= self.max_new_tokens

    def new_tokens(self):
        """The tokens the next forward feeds: those not yet cached (the whole prompt at first, then one)."""
        return self.tokens[self.num_cached:]


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    """``cache``: None (no cache: every step recomputes every running sequence), a ContiguousKVCache or
    a PagedKVCache. ``preempt``: "swap" or "recompute". ``share_prefix``: a paged sequence starts on
    the blocks of the running sequence it shares the longest prompt prefix with (copy-on-write)."""

    def __init__(self, cache, max_batch, preempt="swap", share_prefix=False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if preempt not in ("swap", "recompute"):
            raise ValueError(f"preempt must be 'swap' or 'recompute', got {preempt!r}")
        self.cache, self.max_batch, self.preempt_mode, self.sharing = cache, max_batch, preempt, share_prefix
        self.paged = hasattr(cache, "tables")
        self.waiting, self.running, self.swapped = deque(), [], deque()
        self.preemptions = self.recomputed_tokens = self.shared_tokens = 0

    def add(self, seq):
        self.waiting.append(seq)

    def has_work(self):
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self):
        """Do this step's memory moves; return (prefills, decodes): sequences whose uncached tokens are
        many (a prompt, or all tokens after recomputation) and those with one new token."""
        self._promised = 0         # blocks this step's forwards will allocate (positions() takes them)
        preempted = self._make_room_for_running() if self.paged else False
        if not preempted:
            self._swap_in()
            if not self.swapped:
                self._admit()
        prefills = [s for s in self.running if len(s.new_tokens()) > 1]
        decodes = [s for s in self.running if len(s.new_tokens()) == 1]
        return prefills, decodes

    def finish(self, seq):
        """A sequence produced its last token: its memory goes back."""
        self.running.remove(seq)
        seq.status = FINISHED
        if self.cache is not None:
            self.cache.free_sequence(seq.id)

    # ---- the paged cache: a block for every running sequence's next token, or preemption
    def _make_room_for_running(self):
        queue, kept, preempted = list(self.running), [], False
        while queue:
            seq = queue.pop(0)
            while self.cache.blocks_needed(seq.id, 1) > self._room() and queue:
                self._preempt(queue.pop())                   # the latest admitted goes first
                preempted = True
            need = self.cache.blocks_needed(seq.id, 1)
            if need > self._room():                          # nobody left to preempt but itself
                self._preempt(seq)
                preempted = True
                continue
            self._promised += need
            kept.append(seq)
        self.running = kept
        return preempted

    def _room(self):
        return self.cache.pool.num_free() - self._promised

    def _preempt(self, seq):
        self.preemptions += 1
        if self.preempt_mode == "swap":
            self.cache.swap_out(seq.id)
            seq.status = SWAPPED
            self.swapped.append(seq)
        else:                                                # recompute: its K/V are dropped
            self.cache.free_sequence(seq.id)
            self.recomputed_tokens += seq.num_cached
            seq.num_cached = 0
            seq.status = WAITING
            self.waiting.appendleft(seq)

    def _swap_in(self):
        while self.swapped and len(self.running) < self.max_batch:
            seq = self.swapped[0]
            blocks = self.cache.swapped[seq.id][0].shape[1]
            grow = 1 if seq.num_cached % self.cache.block_size == 0 else 0     # room for its next token
            if blocks + grow > self._room():
                return
            self.swapped.popleft()
            self.cache.swap_in(seq.id)
            self._promised += grow
            seq.status = RUNNING
            self.running.append(seq)

    # ---- admission (first come, first served; a sequence that does not fit stops the queue)
    def _admit(self):
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.cache is None:
                pass
            elif self.paged:                                 # blocks for all its tokens (sharing only saves)
                need = self.cache.blocks_for(len(seq.tokens))
                if need > self._room():
                    return
                self.cache.add_sequence(seq.id)
                self._promised += need
            else:
                if not self.cache.can_add():
                    return
                self.cache.add_sequence(seq.id)
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)

    # ---- prefix sharing (paged): just before a prompt's prefill
    def share_prefix(self, seq):
        """Start ``seq`` (admitted, nothing cached) on the blocks of the running sequence whose cached
        tokens share the longest prefix with its own (all but its last token: the forward must compute
        at least one, for the next token's logits). Called after the step's decodes and the earlier
        prefills, so the source writes nothing more this step: a copy-on-write it causes comes in a
        later step, where the scheduler counts it. Returns the tokens shared."""
        if not (self.paged and self.sharing) or seq.num_cached:
            return 0
        best, length = None, 0
        for other in self.running:
            if other is not seq and other.num_cached:
                n = common_prefix(seq.tokens[:-1], other.tokens[:other.num_cached])
                if n > length:
                    best, length = other, n
        if best is not None:
            self.cache.share_prefix(seq.id, best.id, length)
            seq.num_cached = length
            self.shared_tokens += length
        return length
