"""The two ways `generation.refit.verify_method` checks that a refit's weights landed in the
SGLang servers: `read_back` (samples of the sent tensors read back by name) and
`weights_checker` (SGLang's own snapshot, reset, compare and checksum).
"""
