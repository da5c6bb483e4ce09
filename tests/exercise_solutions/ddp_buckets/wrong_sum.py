"""All-reduces with op='sum': every gradient is p times one process's."""
import numpy as np

from minitrain.autograd.engine import queue_callback
from minitrain.comm import all_reduce


class BucketedDDP:
    def __init__(self, module, comm, bucket_cap_bytes):
        self.module, self.comm = module, comm
        self.buckets, current, size = [], [], 0
        for q in reversed(list(module.parameters())):
            if not q.requires_grad:
                continue
            if current and size + q.data.nbytes > bucket_cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
            current.append(q)
            size += q.data.nbytes
        self.buckets.append(current)
        self.slot = {}
        self.flat, self.ready, self.work = [], [], []
        for b, params in enumerate(self.buckets):
            offset = 0
            for q in params:
                self.slot[id(q)] = (b, offset, offset + q.size)
                offset += q.size
                q.register_post_accumulate_grad_hook(self.hook)
            self.flat.append(np.zeros(offset, params[0].dtype))
            self.ready.append(set())
            self.work.append(None)
        self.pending = False

    def __call__(self, *args):
        return self.module(*args)

    def hook(self, q):
        if not self.pending:
            self.pending = True
            queue_callback(self.finish)
        b, lo, hi = self.slot[id(q)]
        self.flat[b][lo:hi] = q.grad.reshape(-1)
        self.ready[b].add(id(q))
        if len(self.ready[b]) == len(self.buckets[b]):
            self.work[b] = all_reduce(self.comm, self.flat[b], op="sum", async_op=True)

    def finish(self):
        for b, params in enumerate(self.buckets):
            averaged = self.work[b].wait()
            for q in params:
                _, lo, hi = self.slot[id(q)]
                q.grad[...] = averaged[lo:hi].reshape(q.shape)
            self.ready[b].clear()
            self.work[b] = None
        self.pending = False

EXPECT = ['one process', '= p']
