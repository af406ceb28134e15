"""A store of encoder outputs shared by a pool of encoders and read by engines (Mooncake Store).

`entry.py`: keys and the checked entry format (pure); `mooncake.py`: the Mooncake client (the
`mooncake` extra, imported lazily); `shared.py`: the service's lookup before encoding and
publication after.
"""
