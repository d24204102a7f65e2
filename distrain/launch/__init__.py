"""Starting a job: what ``train.py`` does with a composed config (``entry``), starting or adopting ranks
(``ranks``), the fork server CPU ranks fork from, a rank's process group (``process_group``) and SLURM submission
checks (``slurm``). Runs in the launching process, except ``process_group``, which each rank runs as it starts."""
