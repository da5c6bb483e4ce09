"""Blocks on demand, but a shared block is written in place: the other sequence's tokens are overwritten."""


def append_slots(table, start, num_new, block_size, pool):
    for i in range(start // block_size, (start + num_new - 1) // block_size + 1):
        if i == len(table):
            table.append(pool.allocate())
    return [(table[p // block_size], p % block_size) for p in range(start, start + num_new)]

EXPECT = ["sequence 0 reads sequence 1's position 5 at its position 5", "is in sequence 1's table too", "copied before a token is written into it"]
