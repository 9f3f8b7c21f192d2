"""Commands that read a run and never write its topics: status and wait (:mod:`.status`), the summary
(:mod:`.summary`), and the log as a product (:mod:`.runlog`: archive, trace, replay, rescore, export)."""
