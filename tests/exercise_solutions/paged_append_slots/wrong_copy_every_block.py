"""Copies every block the new tokens touch, shared or not: a block only this table holds is copied too."""


def append_slots(table, start, num_new, block_size, pool):
    for i in range(start // block_size, (start + num_new - 1) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
        else:
            fresh = pool.allocate()
            pool.copy(table[i], fresh)
            pool.release(table[i])
            table[i] = fresh
    return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]

EXPECT = ["copied a block", "that only this table holds (refcount 1)", "written in place"]
