"""``flashpar simulate``: cluster-scale predictions from the schedules and plans the runtime executes.

One cost model (:mod:`flashpar.cost`) times everything; nothing here starts a process group.

* :mod:`flashpar.sim.overlap`  ``simulate overlap``: an op or a block, per mode, forward and backward
* :mod:`flashpar.sim.cp`       ``simulate cp``: every strategy's plan at 8 to 1,024 ranks
* :mod:`flashpar.sim.train`    ``simulate train``: one Llama training step on a (dp, cp, ulysses, tp) layout
                               (:mod:`flashpar.sim.predict`: the step from :mod:`flashpar.sim.step`'s pieces on
                               :mod:`flashpar.sim.zero`'s data-parallel lanes; :mod:`flashpar.sim.memory`)
* :mod:`flashpar.sim.table`    ``simulate table``: ``simulate train --search`` over (model, GPUs, seq), markdown
* :mod:`flashpar.sim.anchors`  ``simulate anchors``: torchtitan's published H100 runs, simulated; the
                               ``h100-96gb`` preset's fit
* :mod:`flashpar.sim.check`    ``simulate check BENCH.json``: a benchmark's rows predicted against measured
* :mod:`flashpar.sim.report`   the table every command prints and the ``--json`` file it writes
"""
