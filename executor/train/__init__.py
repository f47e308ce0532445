"""Full training runs on the folded executor: LR schedule, gradient clipping, evaluation, checkpoints.

:func:`executor.train.loop.train_worker` is one rank of a run (launch it with
:func:`executor.launch_local.launch` or the Ray launcher); :func:`executor.train.loop.train_local` launches
a whole run on this machine.
"""
