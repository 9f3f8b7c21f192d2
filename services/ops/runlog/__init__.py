"""Tools over a run's log, on the broker or archived (``common.log_archive``): ``streamppo archive``, ``trace``,
``export`` and ``rescore``. They read; none of them sends to the run's topics or joins its consumer groups."""
