"""What a run leaves and shows: its folder (``runs.Run``), metrics.jsonl and the console line, the plots, the
trackers, memory samples and the trace viewer."""
