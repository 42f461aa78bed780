"""Training a model: the command-line entry (``cli``), the pretraining loop and its Trainer
(``trainer``), when to stop early (``exits``), how failures are reported (``failures``), the
iteration log (``logger``) and the device-side step counters (``counters``)."""
