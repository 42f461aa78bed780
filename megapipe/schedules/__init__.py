"""Pipeline schedules as data: actions, the registry of schedule descriptors and their generators
(``catalog/``), the communication (lowering) pass, transport models, validators, the replay, segments and
programs of asynchronous schedules, schedule files and the text grid; and what a schedule costs
(``analysis/``: the simulator, timelines, pictures, the schedule search). Pure Python: nothing here
touches a tensor or a process group."""
