"""The policy model itself: where its folder is and how it loads, its tokens (end-of-turn ids),
its precision (compute dtype, autocast), and the packed attention mask both engines and trainers
build.

May import: config, run.
"""
