"""Everything decided before anything starts: validating the composed config (`validate`, every
problem at once), the dry-run plan, the chat-template probe, prompt lengths, and which clients
send token ids back.

Torch-free, and the one room that looks up (at generation's template and parsers, the model's
folders and the trainers' capabilities), because a config must be refused before it runs.

May import: config, cluster, model, generation, trainer.
"""
