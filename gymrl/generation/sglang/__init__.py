"""SGLang generation: the client of a group of SGLang servers (`engine`), the server processes
(`servers`), prefix-aware routing, and the refit of their weights (`refit` picks the transport,
`weight_sync` broadcasts, `refit_checks/` checks what landed).

Of generation, may import: types.
"""
