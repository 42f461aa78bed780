"""The command line: Megatron-LM-named flags generated from the dataclasses of ``megapipe.config`` and the
model families' own (``flags.py``), ``--use-checkpoint-args`` (``checkpoint_args.py``), which schedule a run
uses (``selection.py``: a name, a file or the search), and ``parse_config`` (``parse.py``), which turns flags
into a validated ``Config``. Above models, schedules and the planner, because its checks read them all."""
