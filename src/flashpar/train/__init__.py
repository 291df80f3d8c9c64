"""The trainer: ``config.TrainConfig`` (every setting, typed), ``data`` (packed, planned sequences),
``step`` (``build``, ``train_step``: one optimizer step), ``loop`` (``train``: the steps and their
bookkeeping, ``Hooks``), ``metrics`` (``StepMetrics``, the summary), ``checkpoint``, ``check``
(``--check``), ``report`` (``--plot``) and ``run`` (the command: ``launch``)."""
