"""Sharded checkpoints: exact resume, loading into any parallel layout, atomic publication.

On disk (``--save DIR``)::

    DIR/latest_checkpointed_iteration.txt   the newest complete iteration, e.g. "100"
    DIR/iter_0000100/common.json            iteration, consumed samples, schedule, loss scaler,
                                            writing layout, run configuration (JSON)
    DIR/iter_0000100/.metadata              DCP index: every tensor's global shape, dtype, and
                                            each saved piece's offsets and file byte range
    DIR/iter_0000100/__<rank>_0.distcp      the pieces one rank wrote

Tensors are stored under canonical names with whole-model shapes (``state.py`` lists the
keys), so a run with any (t, p, d, v) reads the blocks it needs from pieces written by any
other. Modules: ``shards`` (where a rank's block sits), ``planners`` (DCP glue), ``storage``
(file I/O and integrity), ``state`` (what a rank saves and loads), ``common`` (JSON part),
``validate`` (fit checks), ``paths`` (atomic publication), ``run_state`` (what a run hands over), ``save`` / ``load`` (entry
points),
``offline`` (whole-model access without processes), ``hf`` (Hugging Face GPT-2 and BERT) and
``convert`` (what ``tools/convert_checkpoint.py`` runs).

Asynchronous schedules (PipeDream, 2BW) are not drained for a save: each rank also stores
what its pipeline holds in flight (``megapipe.pipeline.in_flight``: stashed weight versions,
forwards awaiting their backwards with their inputs and random states, accumulated
gradients), and a run resumed in the same layout replays those forwards, so it continues the
trajectory of a run that never stopped. Another layout, schedule or batch split starts with
an empty pipeline and says that the in-flight microbatches were dropped.
"""
