"""What ``lit train`` runs: the checks before the model loads, the services a run starts, the loop, the trainer
processes it drives, the pipeline from stored rollouts to an update and a sync, and ``lit eval``."""
