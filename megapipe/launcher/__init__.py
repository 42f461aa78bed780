"""megapipe's side of torchrun: a user error under torchrun ends the job with its one sentence and
exit status 2 instead of torchrun's report (``usage_errors`` for the workers, ``run`` for
``megapipe-run``, torchrun with that report). Imports no torch until torchrun has."""
