"""The schedule IR: actions, schedule generators, the communication (lowering) pass, transport
models, validators, the replay, segments and programs of asynchronous schedules, schedule files
and the text grid. Pure Python: nothing here touches a tensor or a process group."""
