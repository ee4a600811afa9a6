"""Watching continuous batching refill rows of a running batch."""


def counting_refills(runner) -> list[int]:
    """The sizes of the refills ``runner`` (a decoder) writes into a running batch from now on
    (refills that replace the whole batch are not written, so not counted)."""
    sizes = []
    insert = runner._insert

    def counted(batch_state, refill_state, rows, size, batch):
        sizes.append(size)
        return insert(batch_state, refill_state, rows, size, batch)

    runner._insert = counted
    return sizes
