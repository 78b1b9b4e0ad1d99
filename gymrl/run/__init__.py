"""One run on disk and in time: its folder, checkpoints and their state, atomic writes, the
stop on a signal, and the no-progress watchdog.

May import: config.
"""
