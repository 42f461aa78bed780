"""Pipeline parallelism: the schedule IR (``ir``), its execution (``runtime``) and its analysis
(``analysis``)."""
