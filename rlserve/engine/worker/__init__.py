"""The tensor-parallel ranks of an engine core: the model runner of each, and rank 0's followers."""
