"""Processes and devices: starting torch.distributed and choosing the device (``launch``), the
process groups built once from a layout (``state``), the collectives every module shares
(``collectives``) and the dropout streams of tensor-parallel ranks (``random``)."""
