"""What a person reads of a run: the metrics logger (jsonl, W&B), records read back, the plots,
sweeps' summaries, the offline HTML report and the W&B dashboard.

May import: config, run.
"""
