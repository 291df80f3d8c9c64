"""``flashpar simulate``: cluster-scale predictions from the schedules and plans the runtime executes.

One cost model (:mod:`flashpar.cost`) times everything; nothing here starts a process group.

* :mod:`flashpar.sim.overlap`  ``simulate overlap``: an op or a block, per mode, forward and backward
* :mod:`flashpar.sim.cp`       ``simulate cp``: every strategy's plan at 8 to 1,024 ranks
* :mod:`flashpar.sim.train`    ``simulate train``: one Llama training step on a (dp, cp, ulysses, tp) layout
* :mod:`flashpar.sim.check`    ``simulate check BENCH.json``: a benchmark's rows predicted against measured
* :mod:`flashpar.sim.report`   the table every command prints and the ``--json`` file it writes
"""
