"""The parts of ``gradpress train`` (:mod:`gradpress.testbed.train`, which gathers their public names).

- :mod:`.config`: what a run is (:class:`~.config.TrainConfig`), how it fails (:class:`~.config.TrainFailed`)
- :mod:`.launch`: the launcher: worker processes, the emulated network, the failures they report
- :mod:`.worker`: one rank's training loop, its steps timed and metered, its evaluations
- :mod:`.hooks`: the communication hooks under test and the meter that reads what they spend
- :mod:`.timing`: the copy of a gradient, the unit in which the reports state per-step costs
- :mod:`.options`: ``--option KEY=VALUE``: parsed, typed and checked against the compressor
- :mod:`.checks`: the model spec and what is checked before any worker starts
- :mod:`.parser`: the arguments ``train`` and ``compare`` share
"""
