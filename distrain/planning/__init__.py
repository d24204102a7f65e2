"""Planning a job without running it: the dry run (``dry_run``), each rank's predicted memory on the meta device
under a fake process group (``rank_memory``, ``context_expert``) and model-state bytes measured and predicted
(``memory``)."""
